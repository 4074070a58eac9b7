"""A train loader whose position inside an epoch survives a checkpoint, so a resumed run sees exactly the
batches an uninterrupted run would.

Lightning (2.6) saves ``state_dict()`` of every train loader that has ``state_dict``/``load_state_dict``
(``CombinedLoader._state_dicts``, under ``loops.fit_loop.state_dict.combined_loader``) and, on resume, loads it
before the loader's iterator is first advanced. For a loader with a length Lightning does not prefetch
(``_PrefetchDataFetcher`` prefetches only when the length is unknown), so the batches the loader has
yielded are the batches the loop has consumed.

The order of an epoch is a pure function of ``(seed, epoch)`` (``DistributedSampler``'s rule: Lightning
calls ``set_epoch`` before every epoch, also on resume), so restoring ``{"epoch", "batches"}`` and skipping
that many batches' worth of indices (no data is loaded for them) reproduces the rest of the epoch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import lightning as L
from torch.utils.data import DataLoader, DistributedSampler


class ResumableSampler(DistributedSampler):
    """``DistributedSampler`` (one data-parallel rank's share, shuffled by ``seed + epoch``) that can start the
    next epoch's iteration ``skip`` indices in. Being a ``DistributedSampler``, Lightning keeps it under DDP.

    ``len()`` stays the full epoch length, so the loader's length (and Lightning's epoch bookkeeping) is
    unchanged by a resume.
    """

    def __init__(self, dataset, num_replicas: int = 1, rank: int = 0, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        self.skip = 0

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        skip, self.skip = self.skip, 0
        return iter(indices[skip:])


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` with ``state_dict()``/``load_state_dict()``: ``{"epoch", "batches"}`` yielded so far.

    After ``load_state_dict`` the next iteration of the same epoch starts after ``batches`` batches (with a
    ``ResumableSampler`` by skipping indices, otherwise by drawing and dropping them); an iteration of a
    later epoch starts from the beginning. The epoch is the sampler's (``set_epoch``) or, for samplers
    without one (iterable datasets), the number of iterations started.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._progress: dict[str, int] | None = None
        self._pending: dict[str, int] | None = None
        self._iterations = 0

    def _epoch(self) -> int:
        epoch = getattr(self.sampler, "epoch", None)
        return self._iterations if epoch is None else int(epoch)

    def __iter__(self) -> Iterator[Any]:
        return self._iterate()  # a generator: nothing runs until the first batch is requested

    def _iterate(self) -> Iterator[Any]:
        epoch = self._epoch()
        self._iterations = epoch + 1
        start = self._pending["batches"] if self._pending and self._pending["epoch"] == epoch else 0
        self._pending = None
        self._progress = {"epoch": epoch, "batches": start}
        drop = start
        if start and isinstance(self.sampler, ResumableSampler) and self.batch_size is not None:
            self.sampler.skip, drop = start * self.batch_size, 0
        for batch in super().__iter__():
            if drop:
                drop -= 1
                continue
            self._progress["batches"] += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        """``{"epoch": e, "batches": n}``: ``n`` batches of epoch ``e`` have been handed out."""
        if self._pending is not None:
            return dict(self._pending)
        if self._progress is not None:
            return dict(self._progress)
        return {"epoch": self._epoch(), "batches": 0}

    def load_state_dict(self, state: dict) -> None:
        """Resume from ``state_dict()``: the next iteration of epoch ``state["epoch"]`` skips ``batches``."""
        try:
            pending = {"epoch": int(state["epoch"]), "batches": int(state["batches"])}
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"Not a ResumableDataLoader state (needs integer 'epoch' and 'batches'): {state!r}") from err
        self._pending = pending
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(pending["epoch"])
        else:
            self._iterations = pending["epoch"]


class ResumableDataModule(L.LightningDataModule):
    """Base for DataModules with a ``ResumableDataLoader`` train loader.

    The loader's position is also the DataModule's state: Lightning restores a DataModule's state before
    ``configure_optimizers`` runs, whereas it loads loader states only if the loader is built after the
    restore, which ``trainer.estimated_stepping_batches`` with ``max_epochs`` set prevents (Lightning issue
    #20550). Subclasses build loaders through ``track_train_loader`` and shard with ``data_parallel_shard``.
    """

    def __init__(self) -> None:
        super().__init__()
        self._train_loader: ResumableDataLoader | None = None
        self._resume_state: dict | None = None

    def data_parallel_shard(self) -> tuple[int, int]:
        """``(num_replicas, rank)`` of the attached trainer's data-parallel group, ``(1, 0)`` without one."""
        trainer = getattr(self, "trainer", None)
        kwargs = trainer.distributed_sampler_kwargs if trainer is not None else None
        return (int(kwargs["num_replicas"]), int(kwargs["rank"])) if kwargs else (1, 0)

    def track_train_loader(self, loader: ResumableDataLoader) -> ResumableDataLoader:
        """Apply a restored position (once, to the first loader built after it) and remember the loader."""
        if self._resume_state is not None:
            loader.load_state_dict(self._resume_state)
            self._resume_state = None
        self._train_loader = loader
        return loader

    def state_dict(self) -> dict:
        """``{"train_loader": {"epoch", "batches"}}`` of the loader the trainer iterates (if built)."""
        trainer = getattr(self, "trainer", None)
        loader = getattr(trainer, "train_dataloader", None) if trainer is not None else None
        loader = loader if isinstance(loader, ResumableDataLoader) else self._train_loader
        return {"train_loader": loader.state_dict()} if loader is not None else {}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore the train loader's position: in the loader built last (if any) and in the next one built
        (another module may have built a loader of its own first; the state is keyed by epoch, so a loader of
        a later epoch ignores it)."""
        state = state_dict.get("train_loader")
        if state is not None and self._train_loader is not None:
            self._train_loader.load_state_dict(state)
        self._resume_state = state
