"""What every trainer integration shares: one controller's life over a trainer's ``fit``.

NOTE [ Trainer integrations ]
A trainer owns the loop, the model's wrapping and the optimizer, so a callback can only
attach once the trainer has built them ("fit start") and must detach when fitting ends,
whichever way it ends. The controller still steps on its optimizer step post-hook: the
trainers call the optimizer's ``step`` once per *optimizer* step, so with gradient
accumulation the controller steps once per accumulated step and its capture window spans
the micro-batches. Checkpoints go through the trainer's own mechanism; a state that
arrives before the controller exists (Lightning restores callbacks before ``on_fit_start``
for some strategies) is kept and applied at attach time. The scalars logged are the same
for every integration (:func:`scalars`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from memctl.errors import ConfigError

if TYPE_CHECKING:
    from memctl.controller.controller import Controller

__all__ = ["AttachedCallback", "Attachment", "scalars"]

_log = logging.getLogger("memctl.integrations")

#: (scalar name, stats key) logged by every integration; unknown (None) values are left out.
SCALARS: tuple[tuple[str, str], ...] = (
    ("ratio", "ratio"),
    ("avg_bits", "avg_bits"),
    ("activation_raw_bytes", "raw_bytes"),
    ("activation_packed_bytes", "packed_bytes"),
    ("activation_other_bytes", "other_bytes"),
    ("budget_bytes", "budget_bytes"),
    ("activation_budget_bytes", "activation_budget_bytes"),
    ("fallbacks", "fallbacks"),
)


def scalars(stats: Mapping[str, Any], prefix: str = "memctl/") -> dict[str, float]:
    """The controller's scalars from ``ctl.stats()``: finite numbers only, names prefixed."""
    out: dict[str, float] = {}
    for name, key in SCALARS:
        value = stats.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if math.isfinite(value):
            out[prefix + name] = float(value)
    return out


class Attachment:
    """One controller attached for one ``fit``, built from a callback's arguments.

    Args:
        budget, bits: as for :class:`memctl.Controller`.
        serve: ``None``/``False`` serves nothing; ``True`` serves the HTTP API on a free
            port; an int serves on that port (on the main process only).
        host, token: where to serve and the bearer token (see :meth:`Controller.serve`).
        options: any other :class:`~memctl.ControllerConfig` field.
    """

    def __init__(self, budget: object, bits: float | None, serve: bool | int | None, host: str,
                 token: str | None, options: Mapping[str, Any]) -> None:
        if serve is not None and not isinstance(serve, bool | int):
            raise ConfigError(f"serve={serve!r} must be None, True/False or a port number")
        if isinstance(serve, int) and not isinstance(serve, bool) and not 0 <= serve <= 65535:
            raise ConfigError(f"serve={serve!r} is not a port number (0-65535; 0 picks a free one)")
        self.budget = budget
        self.bits = bits
        self.serve = serve
        self.host = host
        self.token = token
        self.options = dict(options)
        self.controller: Controller | None = None
        self.url: str | None = None
        self._pending_state: dict[str, Any] | None = None
        self._final_state: dict[str, Any] = {}  # saved by a checkpoint taken after fit ends
        self._logged_step = -1

    def attach(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
               main_process: bool = True) -> Controller:
        from memctl.controller.controller import Controller

        self.detach()
        ctl = Controller(model, optimizer, budget=self.budget, bits=self.bits, **self.options)
        if self._pending_state is not None:
            ctl.load_state_dict(self._pending_state)
            self._pending_state = None
        if self.serve not in (None, False) and main_process:
            port = 0 if self.serve is True else int(self.serve)
            self.url = ctl.serve(host=self.host, port=port, token=self.token).url
            _log.info("memctl API at %s", self.url)
        self.controller = ctl
        self._logged_step = ctl.step_count
        return ctl

    def detach(self) -> None:
        if self.controller is not None:
            self._final_state = self.controller.state_dict()
            self.controller.detach()
            self.controller = None
            self.url = None

    def state_dict(self) -> dict[str, Any]:
        if self.controller is not None:
            return self.controller.state_dict()
        if self._pending_state is not None:
            return dict(self._pending_state)
        return dict(self._final_state)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not state:
            return
        if self.controller is not None:
            self.controller.load_state_dict(state)
            self._logged_step = self.controller.step_count
        else:
            self._pending_state = dict(state)

    def new_scalars(self) -> dict[str, float] | None:
        """The scalars once per controller step (None when it has not stepped since the last call)."""
        ctl = self.controller
        if ctl is None or ctl.step_count == self._logged_step:
            return None
        self._logged_step = ctl.step_count
        return scalars(ctl.stats())


class AttachedCallback:
    """What every integration's callback exposes of its :class:`Attachment`."""

    _attachment: Attachment

    @property
    def controller(self) -> Controller | None:
        """The controller while the trainer trains, else ``None``."""
        return self._attachment.controller

    @property
    def url(self) -> str | None:
        """The HTTP API's address while the trainer trains with ``serve``."""
        return self._attachment.url
