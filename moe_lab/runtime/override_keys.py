"""Misspelt keys on the command line, named before Hydra composes the run.

Hydra answers ``task.trainer.max_stepz=3`` with a hint to add the key with ``+``, which then fails later (or trains
without the setting). :func:`check_override_keys` composes the chosen config groups once and refuses a ``key=value``
whose key is not there, naming the nearest known keys (difflib). ``+key=`` / ``++key=`` additions stay Hydra's,
except the ``++method.options.<name>=`` run.py makes of every method option (a method's options are a closed set,
each declared in its conf/method/*.yaml). A command Hydra itself cannot compose (a sweep over a config group, an
unknown group option) is left to Hydra's own message.
"""

from __future__ import annotations

import difflib
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig

METHOD_OPTIONS = "method.options."


def _is_hydra(key: str) -> bool:
    return key == "hydra" or key.startswith(("hydra.", "hydra/"))


def _checked(override, config_dir: Path) -> bool:
    """Does ``override`` set a key the composed config must already have?"""
    key = override.key_or_group
    if override.is_force_add():
        return key.startswith(METHOD_OPTIONS)
    if override.is_add() or override.is_delete() or override.package is not None or _is_hydra(key):
        return False
    return "/" not in key and not (config_dir / key).is_dir()  # not a config group


def _missing_key(cfg: DictConfig, key: str) -> tuple[str, str, list[str]] | None:
    """``(known prefix, missing name, the keys at that prefix)`` for a key ``cfg`` lacks under a map; None when
    ``cfg`` has the key (or something other than a map stands in the way: Hydra says what)."""
    node, parts = cfg, key.split(".")
    for i, part in enumerate(parts):
        if not isinstance(node, DictConfig):
            return None
        known = [str(k) for k in node]  # ``part in node`` is False for a ``???`` value
        if part not in known:
            return ".".join(parts[:i]), part, known
        try:
            node = node[part]
        except Exception:  # noqa: BLE001 - a missing value or an interpolation: not a map to look into
            return None
    return None


def _where(cfg: DictConfig, prefix: str) -> str:
    group = prefix.split(".")[0]
    choice = cfg.hydra.runtime.choices.get(group) if prefix else None
    return f"{group}={choice}" if choice else (f"the config's {prefix}" if prefix else "the config")


def unknown_key_message(cfg: DictConfig, key: str) -> str | None:
    """Why ``key`` is not a key of ``cfg`` and which known key is nearest (None: it is one)."""
    missing = _missing_key(cfg, key)
    if missing is None:
        return None
    prefix, name, known = missing
    full = f"{prefix}.{{}}" if prefix else "{}"
    message = f"{key} is not a key of {_where(cfg, prefix)}"
    nearest = difflib.get_close_matches(name, [k for k in known if not k.startswith("_")], n=3)
    if nearest:
        return f"{message}; did you mean {' or '.join(full.format(k) for k in nearest)}?"
    if not known:
        return f"{message}: it has no keys under {prefix}" if prefix else message
    return f"{message}; its keys{f' under {prefix}' if prefix else ''}: {', '.join(sorted(known))}"


def check_override_keys(args: list[str], config_dir: Path, config_name: str = "config") -> None:
    """Refuse the first override whose key the composed config lacks: ``ValueError`` naming the nearest keys."""
    if any(a.startswith("-") and a not in ("-m", "--multirun") for a in args):
        return  # Hydra's flags (--cfg job, --config-name x, ...): another config or no run, Hydra's own checks
    try:
        overrides = OverridesParser.create().parse_overrides([a for a in args if a not in ("-m", "--multirun")])
    except Exception:  # noqa: BLE001 - a command line Hydra cannot parse: Hydra's own message
        return
    checked = [o for o in overrides if _checked(o, config_dir)]
    base = [o for o in overrides if not _checked(o, config_dir) and not _is_hydra(o.key_or_group)]
    if not checked or any(o.is_sweep_override() for o in base):
        return
    try:
        with initialize_config_dir(config_dir=str(config_dir.resolve()), version_base="1.3"):
            cfg = compose(config_name=config_name, overrides=[o.input_line for o in base], return_hydra_config=True)
    except Exception:  # noqa: BLE001 - a config Hydra cannot compose: Hydra's own message
        return
    for override in checked:
        message = unknown_key_message(cfg, override.key_or_group)
        if message:
            raise ValueError(message)
