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

Window mode (``ResumableDataLoader.count_windows``): the loader reads each gradient-accumulation window ahead and
stamps every dict batch with ``window_tokens``, this rank's real tokens in the window, so a loss can be divided by
the window's token count before backward. The read-ahead batches are not consumed: the saved position still
counts the batches handed out.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import lightning as L
from torch.utils.data import DataLoader, DistributedSampler

from .packing import real_token_mask

#: the key window mode adds to each dict batch: this rank's real tokens in the batch's accumulation window
WINDOW_TOKENS = "window_tokens"


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
    """A ``DataLoader`` with ``state_dict()``/``load_state_dict()``: ``{"epoch", "batches", "examples"}`` yielded so far.

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
        self._window: tuple[int, int | None] | None = None

    def count_windows(self, size: int | None, limit: int | None = None) -> None:
        """Window mode (``size`` >= 1; None turns it off), read by the next iteration: the batches of an epoch
        form windows ``[k * size, (k + 1) * size)`` ending at ``limit`` batches (the epoch's batch limit, e.g.
        Lightning's ``num_training_batches``) or at the epoch's end, as Lightning's gradient accumulation does;
        every dict batch gets ``batch[WINDOW_TOKENS]`` = the real tokens (``real_token_mask``) of its window. A
        resumed epoch's first window runs from the restored position to the next window end."""
        if size is not None and (isinstance(size, bool) or int(size) != size or size < 1):
            raise ValueError(f"window size must be an integer >= 1 (accumulate_grad_batches), got {size!r}")
        self._window = None if size is None else (int(size), None if limit is None else int(limit))

    def _epoch(self) -> int:
        epoch = getattr(self.sampler, "epoch", None)
        return self._iterations if epoch is None else int(epoch)

    def __iter__(self) -> Iterator[Any]:
        return self._iterate()  # a generator: nothing runs until the first batch is requested

    def _iterate(self) -> Iterator[Any]:
        epoch = self._epoch()
        self._iterations = epoch + 1
        pending = self._pending if self._pending and self._pending["epoch"] == epoch else {}
        start, size = pending.get("batches", 0), self.batch_size
        examples = pending.get("examples", start * (size or 0))
        self._pending = None
        if size is not None and examples != start * size:  # resumed with another batch size: the examples count
            if isinstance(self.sampler, ResumableSampler):
                start = examples // size
            elif examples % size:
                raise ValueError(f"the checkpoint's loader position is {examples} examples, not a whole number of "
                                 f"batches of dataset.batch_size={size} (this dataset cannot skip single examples): "
                                 "resume with the run's own batch size or a divisor of the examples seen")
            else:
                start = examples // size
        self._progress = {"epoch": epoch, "batches": start}
        if size is not None:
            self._progress["examples"] = examples
        drop = start
        if (start or examples) and isinstance(self.sampler, ResumableSampler) and size is not None:
            self.sampler.skip, drop = examples, 0
        batches = itertools.islice(super().__iter__(), drop, None)
        if self._window is not None:
            batches = _stamp_windows(batches, start, *self._window)
        for batch in batches:
            self._progress["batches"] += 1  # handed out = consumed (Lightning does not prefetch a sized loader)
            if size is not None:
                self._progress["examples"] += size
            yield batch

    def state_dict(self) -> dict[str, int]:
        """``{"epoch": e, "batches": n, "examples": m}``: ``n`` batches (``m`` examples: batches x batch size; absent
        without a batch size) of epoch ``e`` have been handed out. The examples count lets a resume with another
        batch size continue after the same examples."""
        if self._pending is not None:
            return dict(self._pending)
        if self._progress is not None:
            return dict(self._progress)
        return {"epoch": self._epoch(), "batches": 0, **({"examples": 0} if self.batch_size is not None else {})}

    def load_state_dict(self, state: dict) -> None:
        """Resume from ``state_dict()``: the next iteration of epoch ``state["epoch"]`` skips ``examples`` (a state
        without them: ``batches`` batches)."""
        try:
            pending = {"epoch": int(state["epoch"]), "batches": int(state["batches"])}
            if "examples" in state:
                pending["examples"] = int(state["examples"])
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"Not a ResumableDataLoader state (needs integer 'epoch' and 'batches'): {state!r}") from err
        self._pending = pending
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(pending["epoch"])
        else:
            self._iterations = pending["epoch"]


def _stamp_windows(batches: Iterator[Any], index: int, size: int, limit: int | None) -> Iterator[Any]:
    """Yield ``batches`` (the first one is the epoch's batch ``index``), each stamped with its window's real-token
    count (dict batches with a real-token mask only); each window is read whole before its first batch is
    yielded."""
    while True:
        end = (index // size + 1) * size
        if limit is not None and index < limit:
            end = min(end, limit)
        window = list(itertools.islice(batches, end - index))
        if not window:
            return
        tokens = None
        if all(isinstance(b, dict) for b in window):
            try:  # batches without a real-token mask stay unstamped
                tokens = sum(int(real_token_mask(b).sum()) for b in window)
            except KeyError:
                pass
        for batch in window:
            if tokens is not None:
                batch[WINDOW_TOKENS] = tokens
            yield batch
        index = end


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
