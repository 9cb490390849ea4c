"""Replaying one training step's forward and backward with chosen per-layer precisions.

NOTE [ Replay ]
The calibration (NOTE [ Calibration ]) needs the whole-model weight gradient of the
step with some layers' saved tensors compressed and the others exact. On a calibration
step the controller keeps references to the model's inputs, the CPU (and CUDA) random
state before the forward, and the gradient the loss sent into each model output. At the
step boundary a replay runs the model's forward again under its own saved-tensor hooks
(a private :class:`~memctl.controller.packing.Packer` whose per-layer choice is what
the replay asks for), then ``torch.autograd.grad`` of the outputs against those output
gradients: the user's loss is never called again, and ``.grad`` is never touched. The
random state is restored before each replay (dropout draws the same masks) and the
buffers (BatchNorm's running statistics) are put back after the last one.

The optimizer has already updated the parameters when the boundary runs; every replay
of one probe runs at the same (updated) parameters, so differences between replays are
what the precisions change, nothing else. The output gradients came from the previous
parameters: they only fix a direction to differentiate along, which every replay shares.
A replay holds the raw activations of one forward (what plain PyTorch holds).

The module tracker's exit callback is the replay's packer while it runs, and the replay
ends its forward as training's does (the model's output observed, then the forward's
end), so the replay makes the records training makes: the region matches and rebuilt
outputs found at a module's output, the batch norms' read corrections (NOTE [ A batch
norm's input read twice ]) and the normalised batch-norm inputs (NOTE [ Batch-norm inputs
normalised when no record reads the output ]). Until 2026-11-28 the callback stayed the
controller's packer, and the replays measured records training no longer made: on timm's
MobileOne at ``bits=2``, the first probe's whole allocation measured an infinite added
variance (a batch norm's input in its own coordinates, its small channels read back through
``invstd``) while training's records added 58% of the minibatch gradient's variance, and
the guard raised 226 of 235 layers to 4 bits.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from memctl.controller.config import KEEP_BITS, ControllerConfig
from memctl.controller.hooks import ModuleTracker
from memctl.controller.packing import Packer
from memctl.controller.update_metric import UpdateMetric

__all__ = ["Capture", "Replayer", "exact", "flatten_tensors", "only", "several"]

ChoiceFn = Callable[[str], tuple[float, float | None]]


def flatten_tensors(value: Any) -> list[torch.Tensor | None]:
    """Tensors in ``value`` (tensor, tuple, list, dict) in a fixed order; ``None`` for others."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in flatten_tensors(item)]
    if isinstance(value, Mapping):
        return [t for key in value for t in flatten_tensors(value[key])]
    return [None]


@dataclass
class Capture:
    """What one calibration step keeps to replay it (see NOTE [ Replay ])."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    cpu_rng: torch.Tensor
    cuda_rng: torch.Tensor | None = None
    out_grads: dict[int, torch.Tensor] = field(default_factory=dict)

    def store_grad(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(g: torch.Tensor) -> None:
            self.out_grads[index] = g.detach()

        return hook


class Replayer:
    """Runs replays of one captured step (NOTE [ Replay ])."""

    def __init__(self, config: ControllerConfig, tracker: ModuleTracker, device: torch.device,
                 walking: Callable[[], tuple[bool, bool, bool]] | None = None,
                 metric: UpdateMetric | None = None) -> None:
        self._config = config
        self._metric = metric
        self._gains: tuple[tuple[int, ...], list[torch.Tensor | float]] | None = None
        """The update metric's gains while a probe runs, and the parameters they are of (NOTE
        [ Update metric ] in update_metric.py)."""
        self._tracker = tracker
        self._device = device
        self._walking = walking
        """Whether training's packs walk in full (:attr:`Packer.walking`): its replays walk as it
        does (NOTE [ Walks that find nothing ] in walks.py)."""
        self.raised: frozenset[str] = frozenset()
        """The layers whose records the last replay stored at twice their bits (NOTE [ Widths a
        record is stored at ] in calibration.py)."""

    def begin_metric(self, model: torch.nn.Module) -> str:
        """Take the optimizer's gains for the replays to come (NOTE [ Update metric ]), until
        :meth:`end_metric`: the metric their gradients are in, ``"update"`` or ``"gradient"``."""
        params = [p for p in model.parameters() if p.requires_grad]
        gains = self._metric.gains(params) if self._metric is not None else None
        self._gains = None if gains is None else (tuple(map(id, params)), gains)
        return "gradient" if gains is None else "update"

    def end_metric(self) -> None:
        """Let the gains go: later replays are in the gradient's metric."""
        self._gains = None

    def capture(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Capture:
        cuda_rng = None
        if self._device.type == "cuda":
            cuda_rng = torch.cuda.get_rng_state(self._device)
        return Capture(args=args, kwargs=dict(kwargs), cpu_rng=torch.get_rng_state(), cuda_rng=cuda_rng)

    def watch_outputs(self, capture: Capture, output: Any) -> None:
        """Hook every float output that requires grad to keep the gradient the loss sends it."""
        for i, t in enumerate(flatten_tensors(output)):
            if t is not None and t.requires_grad and t.is_floating_point():
                t.register_hook(capture.store_grad(i))

    def gradient(self, model: torch.nn.Module, capture: Capture, choice_for: ChoiceFn, seed: int,
                 part: tuple[int, int] | None = None) -> torch.Tensor | None:
        """The flat parameter gradient of one replay (``None`` when the replay cannot run), each
        parameter's times its gains between :meth:`begin_metric` and :meth:`end_metric`.

        ``part`` = (start, length) replays only those samples of the batch (inputs and
        output gradients narrowed along ``batch_dim``).
        """
        params = [p for p in model.parameters() if p.requires_grad]
        if not params or not capture.out_grads:
            return None
        args, kwargs, grads = capture.args, capture.kwargs, capture.out_grads
        if part is not None:
            batch = _batch_of(args, kwargs, self._config.batch_dim)
            if batch is None:
                return None
            narrowed = _narrow((args, kwargs, grads), batch, self._config.batch_dim, part)
            if narrowed is None:
                return None
            args, kwargs, grads = narrowed
        # log-softmax outputs exact: a measurement holds only its layer's noise (NOTE [ Log-probabilities ])
        packer = Packer(replace(self._config, log_prob_bits=None), self._tracker, choice_for,
                        lambda layer, exc: None, queue=False)  # NOTE [ Packs queued in the forward ]
        packer.set_parameters(model)
        packer.begin_step(seed)
        if self._walking is not None:
            packer.walking = self._walking()
        devices = [self._device.index or 0] if self._device.type == "cuda" else []
        self._tracker.reset()
        self._tracker.model_depth = 1
        # the replay's module outputs go to its own packer, as training's go to the controller's
        # (region matches, the batch-norm read corrections, the normalised batch-norm inputs)
        on_exit, self._tracker.on_exit = self._tracker.on_exit, packer.observe
        try:
            with torch.random.fork_rng(devices=devices), torch.enable_grad():
                torch.set_rng_state(capture.cpu_rng)
                if capture.cuda_rng is not None:
                    torch.cuda.set_rng_state(capture.cuda_rng, self._device)
                if self._config.keep_inputs:
                    packer.inputs.set((*args, *kwargs.values()))  # NOTE [ Model inputs ], as in training
                with torch.autograd.graph.saved_tensors_hooks(packer.pack, packer.unpack):
                    out = model(*args, **kwargs)
                    packer.observe(out)  # the model's own output, then its forward's end, as in training
                    packer.end_forward(out)
                outs: list[torch.Tensor] = []
                cotangents: list[torch.Tensor] = []
                flat = flatten_tensors(out)
                for i, g in grads.items():
                    t = flat[i] if i < len(flat) else None
                    if t is None or t.shape != g.shape or not t.requires_grad:
                        return None
                    outs.append(t)
                    cotangents.append(g)
                got = torch.autograd.grad(outs, params, cotangents, allow_unused=True)
        finally:
            self._tracker.on_exit = on_exit
            records = packer.finish_step()
            self.raised = frozenset(name for name, rec in records.items() if rec.raised_values)
            self._tracker.reset()
        flat_grads = [(d if d is not None else torch.zeros_like(p)).detach().reshape(-1).float()
                      for d, p in zip(got, params, strict=True)]
        if self._gains is not None and self._gains[0] == tuple(map(id, params)):
            # NOTE [ Update metric ]: a 0-d gain (or a number) per parameter
            return torch.cat([torch.mul(d, gain) for d, gain in zip(flat_grads, self._gains[1], strict=True)])
        return torch.cat(flat_grads)


def only(layer: str, bits: float, error_bound: float | None) -> ChoiceFn:
    """A choice function: ``layer`` at ``bits`` (and error bound), every other layer exact."""

    def choice(name: str) -> tuple[float, float | None]:
        return (bits, error_bound) if name == layer else (float(KEEP_BITS), None)

    return choice


def several(choices: Mapping[str, tuple[float, float | None]]) -> ChoiceFn:
    """A choice function: each layer of ``choices`` at its (bits, error bound), every other exact."""
    wanted = dict(choices)

    def choice(name: str) -> tuple[float, float | None]:
        return wanted.get(name, (float(KEEP_BITS), None))

    return choice


def exact(name: str) -> tuple[float, float | None]:
    """A choice function that keeps every layer exact."""
    return float(KEEP_BITS), None


def _batch_of(args: tuple[Any, ...], kwargs: dict[str, Any], dim: int) -> int | None:
    for t in flatten_tensors((args, kwargs)):
        if t is not None and t.dim() > dim:
            return int(t.shape[dim])
    return None


def _narrow(value: Any, batch: int, dim: int, part: tuple[int, int]) -> Any:
    """``value`` with every tensor holding the batch narrowed to ``part`` (None if a tensor cannot be)."""
    if isinstance(value, torch.Tensor):
        if value.dim() > dim and value.shape[dim] == batch:
            return value.narrow(dim, part[0], part[1])
        return value if value.dim() <= dim else None
    if isinstance(value, tuple):
        items = [_narrow(v, batch, dim, part) for v in value]
        return None if any(i is None and v is not None for i, v in zip(items, value, strict=True)) \
            else tuple(items)
    if isinstance(value, list):
        items = [_narrow(v, batch, dim, part) for v in value]
        return None if any(i is None and v is not None for i, v in zip(items, value, strict=True)) else items
    if isinstance(value, dict):
        out = {k: _narrow(v, batch, dim, part) for k, v in value.items()}
        return None if any(out[k] is None and value[k] is not None for k in value) else out
    return value
