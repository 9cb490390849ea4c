"""``MemctlCallback`` for ``transformers.Trainer`` (extra ``memctl[huggingface]``).

>>> trainer = transformers.Trainer(model, args, train_dataset=ds,
...                                callbacks=[MemctlCallback(budget="12GiB", serve=8765)])  # doctest: +SKIP

See NOTE [ Trainer integrations ] in :mod:`memctl.integrations._attachment`.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch

from memctl._extras import import_extra

import_extra("transformers.trainer_callback", "huggingface", "memctl.integrations.huggingface")

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments  # noqa: E402

from memctl.errors import ConfigError  # noqa: E402
from memctl.integrations._attachment import AttachedCallback, Attachment, scalars  # noqa: E402

if TYPE_CHECKING:
    pass

__all__ = ["STATE_FILE", "MemctlCallback"]

_log = logging.getLogger("memctl.integrations")

#: The controller's state inside each of the Trainer's ``checkpoint-<step>`` folders.
STATE_FILE = "memctl_controller.pt"

# NOTE [ The Trainer's optimizer and checkpoints ]
# The Trainer hands callbacks accelerate's ``AcceleratedOptimizer``, a wrapper that does not
# run ``torch.optim.Optimizer.__init__`` and so never fires step hooks registered on itself;
# it calls the wrapped optimizer's ``step`` only when gradients are synchronised, i.e. once
# per accumulated step (``gradient_accumulation_steps``). The controller therefore hooks
# the wrapped optimizer (``.optimizer``) and steps once per optimizer step. The model's
# forward is called for every micro-batch, which opens the capture window as usual.
# Checkpoints: ``on_save`` runs right after the Trainer wrote ``checkpoint-<global_step>``;
# the controller's state goes next to it as STATE_FILE. On resume the Trainer restores its
# ``TrainerState`` before ``on_train_begin``, so a ``global_step`` above 0 means a resumed
# run; the state is read from ``resume_from`` (the callback's argument),
# ``args.resume_from_checkpoint``, or ``<output_dir>/checkpoint-<global_step>``.
# Logging: ``on_log`` adds the scalars to the ``logs`` dict (seen by every reporting
# callback after this one) and to the entry just appended to ``state.log_history``.


class MemctlCallback(AttachedCallback, TrainerCallback):
    """Attach a :class:`memctl.Controller` to the Trainer's model for the length of ``train``.

    Args:
        budget: device-memory budget (``"12GiB"``, ``"75%"``, bytes or ``None``).
        bits: average bits per value without a budget.
        serve: ``True`` serves memctl's HTTP API on a free port, an int on that port (on
            the main process only); ``None`` (default) serves nothing. See :attr:`url`.
        host, token: where the API binds and its bearer token.
        log: add the controller's scalars (``memctl/ratio``, ``memctl/avg_bits``, activation
            bytes, budget) to every Trainer log.
        resume_from: a checkpoint folder to read the controller's state from when the
            Trainer resumes (default: found as NOTE [ The Trainer's optimizer and checkpoints ]).
        **options: any :class:`memctl.ControllerConfig` field (``min_numel=...``).

    To have reporting integrations listed before this callback (``report_to``) see the
    scalars too, insert it first: ``trainer.callback_handler.callbacks.insert(0, cb)``.
    """

    def __init__(self, budget: object = None, bits: float | None = None, serve: bool | int | None = None, *,
                 host: str = "127.0.0.1", token: str | None = None, log: bool = True,
                 resume_from: str | os.PathLike[str] | None = None, **options: Any) -> None:
        self._attachment = Attachment(budget, bits, serve, host, token, options)
        self._log = log
        self._resume_from = resume_from

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       model: torch.nn.Module | None = None, optimizer: Any = None, **kwargs: Any) -> None:
        if model is None:
            raise ConfigError("the Trainer passed no model to on_train_begin; memctl needs one to attach to")
        inner = getattr(optimizer, "optimizer", optimizer)  # NOTE [ The Trainer's optimizer and checkpoints ]
        if inner is not None and not isinstance(inner, torch.optim.Optimizer):
            inner = None
        if state.global_step > 0:
            self._restore(args, state)
        self._attachment.attach(model, inner, main_process=state.is_world_process_zero)

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        ctl = self._attachment.controller
        if ctl is None or not self._log or logs is None:
            return
        values = scalars(ctl.stats())
        logs.update(values)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(values)

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                **kwargs: Any) -> None:
        ctl = self._attachment.controller
        if ctl is None or not args.should_save:
            return
        folder = os.path.join(str(args.output_dir), f"checkpoint-{state.global_step}")
        if os.path.isdir(folder):
            torch.save(ctl.state_dict(), os.path.join(folder, STATE_FILE))

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self._attachment.detach()

    def _restore(self, args: TrainingArguments, state: TrainerState) -> None:
        candidates = [self._resume_from, getattr(args, "resume_from_checkpoint", None),
                      os.path.join(str(args.output_dir), f"checkpoint-{state.global_step}")]
        for folder in candidates:
            if isinstance(folder, str | os.PathLike) and os.path.isfile(os.path.join(folder, STATE_FILE)):
                path = os.path.join(folder, STATE_FILE)
                self._attachment.load_state_dict(torch.load(path, weights_only=True))
                _log.info("memctl: controller state restored from %s", path)
                return
        _log.warning("resuming at step %d but no %s was found (looked in %s); the controller starts fresh",
                     state.global_step, STATE_FILE, [str(c) for c in candidates if c])
