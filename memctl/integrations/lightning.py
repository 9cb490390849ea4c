"""``MemctlCallback`` for ``lightning.Trainer`` (extra ``memctl[lightning]``).

>>> trainer = lightning.Trainer(callbacks=[MemctlCallback(budget="12GiB", serve=8765)])  # doctest: +SKIP

See NOTE [ Trainer integrations ] in :mod:`memctl.integrations._attachment`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memctl._extras import import_extra

import_extra("lightning.pytorch", "lightning", "memctl.integrations.lightning")

import lightning.pytorch as pl  # noqa: E402  (after the check above, for its one-line error)

from memctl.integrations._attachment import AttachedCallback, Attachment  # noqa: E402

if TYPE_CHECKING:
    pass

__all__ = ["MemctlCallback"]

# NOTE [ Lightning's training step ]
# Lightning calls ``training_step``, not the LightningModule's ``forward``; many modules call
# a submodule (``self.net(x)``) there, so the controller's forward pre-hook on the
# LightningModule would never open the capture window. The callback opens it in
# ``on_train_batch_start`` (``Controller.begin_step``, a no-op while it is open, so the
# micro-batches of an accumulated step share one window). Lightning steps the user's own
# torch optimizer (``LightningOptimizer`` calls its ``step`` with the closure), so the
# controller's step post-hook fires once per optimizer step, after the closure's backward;
# with ``accumulate_grad_batches=k`` that is once every k batches, and the scalars are
# logged once per optimizer step.


class MemctlCallback(AttachedCallback, pl.Callback):
    """Attach a :class:`memctl.Controller` to the LightningModule for the length of ``fit``.

    Args:
        budget: device-memory budget (``"12GiB"``, ``"75%"``, bytes or ``None``).
        bits: average bits per value without a budget.
        serve: ``True`` serves memctl's HTTP API on a free port, an int on that port
            (global rank 0 only); ``None`` (default) serves nothing. See :attr:`url`.
        host, token: where the API binds and its bearer token.
        log: log the controller's scalars (``memctl/ratio``, ``memctl/avg_bits``, activation
            bytes, budget) through the trainer's loggers once per optimizer step.
        **options: any :class:`memctl.ControllerConfig` field (``min_numel=...``).

    The controller's state is saved in Lightning's checkpoints (this callback's
    ``state_dict``) and restored when fitting resumes from one (``ckpt_path=...``).
    """

    def __init__(self, budget: object = None, bits: float | None = None, serve: bool | int | None = None, *,
                 host: str = "127.0.0.1", token: str | None = None, log: bool = True, **options: Any) -> None:
        super().__init__()
        self._attachment = Attachment(budget, bits, serve, host, token, options)
        self._log = log

    # -- lifecycle --------------------------------------------------------------------
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        optimizers = list(trainer.optimizers)
        # With several optimizers (manual optimisation) the first one's step is the step boundary.
        self._attachment.attach(pl_module, optimizers[0] if optimizers else None,
                                main_process=trainer.is_global_zero)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        ctl = self._attachment.controller
        if ctl is not None:
            ctl.begin_step()  # NOTE [ Lightning's training step ]

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        values = self._attachment.new_scalars()
        if values and self._log:
            pl_module.log_dict(values, on_step=True, on_epoch=False, logger=True, batch_size=1)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._attachment.detach()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        ctl = self._attachment.controller
        if ctl is not None:
            ctl.abort_step()
        self._attachment.detach()

    # -- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return self._attachment.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._attachment.load_state_dict(state_dict)
