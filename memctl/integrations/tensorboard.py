"""TensorBoard logging of a controller's scalars (extra ``memctl[tensorboard]``).

>>> ctl = memctl.Controller(model, optimizer, budget="12GiB")          # doctest: +SKIP
>>> tb = TensorBoardLogger(ctl, "runs/memctl")                        # doctest: +SKIP
>>> ...  # train as usual: every optimizer step writes memctl/ratio, memctl/avg_bits, ...
>>> tb.close()                                                        # doctest: +SKIP

The scalars are those the trainer callbacks log (:func:`memctl.integrations._attachment.scalars`),
written with ``torch.utils.tensorboard.SummaryWriter`` at the controller's step.
"""

from __future__ import annotations

import os
import weakref
from typing import TYPE_CHECKING, Any

from memctl._extras import import_extra

import_extra("torch.utils.tensorboard", "tensorboard", "memctl.integrations.tensorboard")

from torch.utils.tensorboard import SummaryWriter  # noqa: E402

from memctl.integrations._attachment import scalars  # noqa: E402

if TYPE_CHECKING:
    from memctl.controller.controller import Controller

__all__ = ["TensorBoardLogger"]


class TensorBoardLogger:
    """Writes the controller's scalars to TensorBoard after every optimizer step.

    The logger registers its own step post-hook on the controller's optimizer, after the
    controller's, so it sees the step the controller just completed. Without an optimizer,
    call :meth:`log` after each ``ctl.step()``. :meth:`close` removes the hook and flushes.

    Args:
        controller: the controller to read.
        log_dir: the TensorBoard run directory (created if missing).
        every: write every ``every`` controller steps.
    """

    def __init__(self, controller: Controller, log_dir: str | os.PathLike[str], *, every: int = 1) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            from memctl.errors import ConfigError

            raise ConfigError(f"every={every!r} must be a positive int (write every N controller steps)")
        self._controller = controller
        self._every = every
        self._writer = SummaryWriter(log_dir=str(log_dir))
        self._last = -1
        self._handle: Any = None
        if controller.optimizer is not None:
            ref = weakref.ref(self)

            def after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
                logger = ref()
                if logger is not None:
                    logger.log()

            self._handle = controller.optimizer.register_step_post_hook(after_step)

    @property
    def log_dir(self) -> str:
        return str(self._writer.log_dir)

    def log(self) -> None:
        """Write the scalars of the controller's last step (once per step)."""
        step = self._controller.step_count
        if step == self._last or step % self._every:
            return
        self._last = step
        for name, value in scalars(self._controller.stats()).items():
            self._writer.add_scalar(name, value, global_step=step)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._writer.close()

    def __enter__(self) -> TensorBoardLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
