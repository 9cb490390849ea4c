"""The OOM guard: one training step that survives ``torch.OutOfMemoryError``.

NOTE [ OOM guard ]
The guard runs forward and backward on the whole batch. If that raises
``torch.OutOfMemoryError``, it drops the partial step, splits the batch into twice as
many micro-batches and retries, accumulating gradients with each micro-batch's loss
weighted by its share of the batch, so the optimizer step sees the gradient of the whole
batch (for a loss that is a mean over samples). The controller then caps its batch size
at the largest micro-batch that fitted, and the event is recorded.
See docs/design.md, "The OOM guard".
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from memctl.controller.config import ControllerConfig
from memctl.errors import ConfigError, MemctlError

__all__ = ["GuardedController", "guarded_step", "split_batch"]

_log = logging.getLogger("memctl.controller")


class GuardedController(Protocol):
    """What the guard needs of a controller (:class:`memctl.Controller` is one).

    A protocol rather than an import, so this module does not depend on the controller
    that calls it.
    """

    @property
    def optimizer(self) -> torch.optim.Optimizer | None: ...

    @property
    def config(self) -> ControllerConfig: ...

    def abort_step(self) -> None: ...

    def lower_batch_estimate(self, largest_ok: int) -> None: ...


def batch_length(batch: Any, dim: int = 0) -> int:
    """Samples in ``batch``: the size along ``dim`` of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[dim])
    if isinstance(batch, Mapping):
        for v in batch.values():
            return batch_length(v, dim)
    if isinstance(batch, list | tuple):
        for v in batch:
            if isinstance(v, torch.Tensor | Mapping | list | tuple):
                return batch_length(v, dim)
    raise ConfigError(f"cannot find a tensor in the batch ({type(batch).__name__}) to split")


def split_batch(batch: Any, parts: int, dim: int = 0) -> list[Any]:
    """Split every tensor of ``batch`` into ``parts`` chunks along ``dim``; others are shared."""
    if isinstance(batch, torch.Tensor):
        return list(torch.tensor_split(batch, parts, dim=dim))
    if isinstance(batch, Mapping):
        cols = {k: split_batch(v, parts, dim) for k, v in batch.items()}
        return [{k: cols[k][i] for k in batch} for i in range(parts)]
    if isinstance(batch, list | tuple):
        cols2 = [split_batch(v, parts, dim) for v in batch]
        return [type(batch)(c[i] for c in cols2) for i in range(parts)]
    return [batch] * parts


def guarded_step(
    ctl: GuardedController,
    compute_loss: Callable[[Any], torch.Tensor],
    batch: Any,
    *,
    max_splits: int = 6,
) -> float:
    """One optimizer step over ``batch`` (see NOTE [ OOM guard ]); returns the batch's loss.

    ``compute_loss(micro_batch)`` must return the mean loss over the samples it is given.
    """
    optimizer = ctl.optimizer
    if optimizer is None:
        raise ConfigError("the OOM guard needs the controller's optimizer: Controller(model, optimizer)")
    n = batch_length(batch, ctl.config.batch_dim)
    parts, splits = 1, 0
    while True:
        try:
            optimizer.zero_grad(set_to_none=True)
            total = 0.0
            for micro in split_batch(batch, parts, ctl.config.batch_dim):
                m = batch_length(micro, ctl.config.batch_dim)
                if m == 0:
                    continue
                loss = compute_loss(micro) * (m / n)
                loss.backward()
                total += float(loss.detach())
            break
        except torch.OutOfMemoryError as exc:
            ctl.abort_step()
            optimizer.zero_grad(set_to_none=True)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            splits += 1
            if splits > max_splits or parts * 2 > n:
                raise MemctlError(
                    f"out of memory even with the batch of {n} split into {parts} micro-batches "
                    f"({max_splits} splits allowed); lower the budget's static share or the model size"
                ) from exc
            parts *= 2
            _log.warning("out of memory at batch size %d: retrying as %d micro-batches", n, parts)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if parts > 1:
        ctl.lower_batch_estimate(-(-n // parts))
    return total
