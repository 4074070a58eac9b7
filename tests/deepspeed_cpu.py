"""Lightning's DeepSpeed strategy on DeepSpeed's CPU accelerator (gloo), for tests of whole runs.

Lightning refuses DeepSpeed off CUDA in three places that are checks, not arithmetic: ``setup_environment``
(CUDA-only), ``_validate_device_index_selection`` (a CPU device has no index) and the ``device_rank`` it hands
``deepspeed.initialize`` (``root_device.index``, None on CPU; DeepSpeed's "no device index" is -1). DeepSpeed's
own engine runs ZeRO-1/2/3 and its offload on its CPU accelerator over gloo (tests/runtime/test_z3_families.py), so
with these three checks lifted ``run.execute`` runs a preset's real DeepSpeed hardware config end to end: moe-lab's
strategy preparation, the method's hooks, DeepSpeed's checkpointing and the gathered export. Never used by moe-lab
itself: a user's ``hardware=deepspeed_*`` on a machine without a GPU is still refused by Lightning.
"""

from __future__ import annotations


def allow_deepspeed_on_cpu() -> None:
    """Lift Lightning's three CUDA-only checks of its DeepSpeed strategy in this process (module docstring)."""
    import deepspeed
    import lightning.fabric.strategies.deepspeed as fabric_deepspeed
    import lightning.pytorch.strategies.deepspeed as pl_deepspeed
    from lightning.pytorch.strategies.ddp import DDPStrategy

    pl_deepspeed.DeepSpeedStrategy.setup_environment = DDPStrategy.setup_environment
    pl_deepspeed._validate_device_index_selection = fabric_deepspeed._validate_device_index_selection = (
        lambda devices: None)
    initialize = deepspeed.initialize

    def initialize_on_cpu(args=None, **kwargs):
        if args is not None and getattr(args, "device_rank", 0) is None:
            args.device_rank = -1
        return initialize(args=args, **kwargs)

    deepspeed.initialize = initialize_on_cpu
