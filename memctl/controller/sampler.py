"""``AdaptiveBatchSampler``: batches that follow the controller's batch size."""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import TYPE_CHECKING

import torch
from torch.utils.data import Sampler

from memctl.errors import ConfigError

if TYPE_CHECKING:
    from memctl.controller.controller import Controller

__all__ = ["AdaptiveBatchSampler"]


class AdaptiveBatchSampler(Sampler[list[int]]):
    """A batch sampler whose every batch takes the controller's current batch size.

    Use it as ``DataLoader(dataset, batch_sampler=AdaptiveBatchSampler(dataset, ctl))``.
    Within an epoch every sample is yielded exactly once, whatever the batch size does
    between batches: the epoch's order is fixed when it starts, and each batch takes the
    next ``ctl.batch_size`` indices of it. With worker processes, batches already fetched
    ahead keep the size they were cut with.

    Args:
        data_source: the dataset (anything with ``len``) or its length.
        controller: the :class:`memctl.Controller` to follow.
        batch_size: the size until the controller has one.
        shuffle: a new random order each epoch (seeded by ``seed`` and the epoch).
        drop_last: drop a final batch shorter than the size in force.
        seed: base seed of the shuffling.
    """

    def __init__(
        self,
        data_source: Sized | int,
        controller: Controller,
        *,
        batch_size: int = 32,
        shuffle: bool = True,
        drop_last: bool = False,
        seed: int = 0,
    ) -> None:
        n = data_source if isinstance(data_source, int) else len(data_source)
        if isinstance(n, bool) or n < 0:
            raise ConfigError(f"data_source has length {n!r}; expected a dataset or a length >= 0")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch_size={batch_size!r}: must be an int >= 1")
        self._n = n
        self._ctl = controller
        self._initial = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose order the next iteration uses (as DistributedSampler)."""
        self.epoch = epoch

    @property
    def current_batch_size(self) -> int:
        size = self._ctl.batch_size
        return max(1, int(size)) if size else self._initial

    def __iter__(self) -> Iterator[list[int]]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self._n, generator=g).tolist()
        else:
            order = list(range(self._n))
        pos = 0
        while pos < self._n:
            size = self.current_batch_size
            batch = order[pos : pos + size]
            if self.drop_last and len(batch) < size:
                break
            pos += len(batch)
            yield batch
        self.epoch += 1

    def __len__(self) -> int:
        size = self.current_batch_size
        return self._n // size if self.drop_last else -(-self._n // size)
