"""The LightningModule class a method config names (``method._target_``): its class attributes are the facts a run
reads of a method before building it (:class:`moe_lab.methods.base.MoELightningModule`), so the floors below the
methods read them by the recorded name, without importing the methods."""

from __future__ import annotations

import logging

from hydra.utils import get_class

log = logging.getLogger(__name__)


def module_class(method_cfg) -> type:
    """The class ``method_cfg._target_`` names; a ValueError naming the field when it has none."""
    target = method_cfg.get("_target_") if method_cfg is not None else None
    if not target:
        raise ValueError("method._target_ is missing: a method config names its LightningModule class "
                         "(e.g. moe_lab.methods.base.MoELightningModule)")
    return get_class(str(target))


def module_fact(method_cfg, name: str, default=None):
    """The class attribute ``name`` of the class a (possibly recorded) method config names; ``default`` when the
    config names none or a class that no longer imports (a run written by another version)."""
    try:
        return getattr(module_class(method_cfg), name, default)
    except ValueError:
        return default
    except ImportError:
        log.warning("method._target_=%s does not import here: its %s is read as %r", method_cfg.get("_target_"),
                    name, default)
        return default
