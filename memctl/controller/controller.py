"""The :class:`Controller`: attach to a model and optimizer, compress saved activations,
allocate bits, hold a memory budget and size the batch.

NOTE [ Step lifecycle ]
The model's forward pre-hook opens the capture window (NOTE [ Capture window ]); the
pack hook compresses each saved tensor at its layer's current bits and accounts it;
backward unpacks and, through hooks on module outputs, measures ‖∇Y‖²; the optimizer's
step post-hook closes the window and runs the step boundary: fold the step's records
into per-layer EMAs, measure static memory, apply a budget queued from any thread,
re-solve the allocation every ``allocation_interval`` steps or at once after a budget
change, recompute the batch size and publish an immutable snapshot for readers (the
HTTP API) when one is wanted (NOTE [ Lazy publication ]). Nothing in the hot path waits
on a reader.
The whole step, and what each part reads and writes: docs/design.md, "One training step".

NOTE [ Errors at the step boundary ]
The boundary runs inside the user's ``optimizer.step()``. memctl must never end a
training run, so any exception from the statistics, policy or allocation code there is
caught: it is logged (with its traceback), counted (``stats()["errors"]``) and recorded
as an ``error`` event; the step still advances, the step's records are dropped, and the
layers keep the bits of the last allocation that succeeded.

NOTE [ One boundary per step ]
With an optimizer the controller advances in the optimizer's step post-hook; ``step()`` is
for a controller made without one. Training loops written for the latter, or for both,
call ``ctl.step()`` after ``optimizer.step()`` too, and each call was a second boundary:
a step with no forward, whose empty records replaced the real step's in ``stats()``
(``raw_bytes`` 0, ``ratio`` 1.0 on every read), with the step count, the allocation's
cadence and the probes' share running at twice the rate. So a ``step()`` after the
optimizer's hook made the boundary, before the model's next forward under grad, is
ignored, with one warning (and a log line) that says why. Without an optimizer every call
advances, as before.

NOTE [ Skipped optimizer steps ]
A gradient scaler (``torch.amp.GradScaler``, fp16 training) skips ``optimizer.step()``
when the gradients overflowed: at the start of every fp16 run (the first scales are too
large) and now and then later. No step hook fires, so the next forward was counted as
another micro-batch of the same step (twelve skipped steps: ``micro_batches`` 12), the
calibration probe replayed a capture twelve forwards old, and the guard read its result
as an absurd gradient and raised bits. A skipped step is known by its gradients: one
parameter of the optimizer's is watched (a post-accumulate-grad hook says a backward
reached it), and when the model's next forward starts with that gradient cleared
(``zero_grad()`` sets it to None) the step boundary runs there, as at an optimizer step
(without a probe: it runs inside the model's forward pre-hook), with a ``skipped_step``
event the first time. Gradient accumulation keeps the gradient between micro-batches and
is not mistaken for it; nor is a setup whose ``.grad`` is never filled (FSDP2 between
synchronised micro-batches, sharded optimizers), since the hook then never fires. After
``zero_grad(set_to_none=False)`` a skipped step still counts as a micro-batch, as before.

NOTE [ Wrapped optimizers ]
accelerate's ``Accelerator.prepare`` returns an ``AcceleratedOptimizer``: a subclass of
``torch.optim.Optimizer`` that does not run its ``__init__``, so it has no step hooks
(registering one raised ``AttributeError`` inside ``Controller(...)``), and that calls the
optimizer it wraps (``.optimizer``) only when the gradients are synchronised, once per
accumulated step. The controller hooks the wrapped optimizer instead (through up to four
such wrappers), which steps once per real optimizer step; ``ctl.optimizer`` is that one. A
wrapper without hooks and without a wrapped optimizer is a ``ConfigError`` that names the
two ways out.

NOTE [ Small tensors kept as they are ]
A float tensor under ``min_numel`` values is kept as it is: the pack hook's Python costs
tens of microseconds a tensor, as much as the op that saved a small one. A loop over time
steps written in Python (an RNN cell, RWKV's and Mamba's reference scans in transformers, a
custom recurrence) saves a few small tensors a step, and then most of the activation
memory is in them: RWKV of ``fidelity.py``'s sweep (16 sequences, width 128) saved 16 x 128
values a tensor and memctl held 2.4x less than plain; with ``min_numel=1024``, 8.0x at the
same loss, in twice the step time. The controller does not lower the threshold on its own
(the cost is the user's to choose); when such tensors hold at least half of a step's
activation bytes and at least :data:`_SMALL_HINT_BYTES`, it says so once: a
``small_tensors`` event and a warning that name the share, the threshold and the fix.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType, TracebackType
from typing import TYPE_CHECKING, Any

import torch

from memctl.codecs.quantize import settle_checks
from memctl.controller import memory, oom, policy
from memctl.controller.bottlenecks import bottleneck_layers
from memctl.controller.budget import BudgetSpec, format_bytes, parse_budget, resolve_budget
from memctl.controller.calibration import Calibration
from memctl.controller.config import KEEP_BITS, ControllerConfig, Objective
from memctl.controller.copysafe import ControllerHook, managing_hooks
from memctl.controller.device import resolve_device
from memctl.controller.distributed import RankSync, local_rank, rank_info, resolve_group
from memctl.controller.gates import GateFloors
from memctl.controller.guard import ConvergenceGuard, LayerNoise
from memctl.controller.hooks import MODEL, ROOT, ModuleTracker, SavedTensorScope, hookable_modules
from memctl.controller.packing import Packer
from memctl.controller.probe import ProbeResult, run_probe
from memctl.controller.probe_share import apply_share, replay_module, share_probe
from memctl.controller.publication import Publication
from memctl.controller.recurrent import LEAST_BITS, RecurrentMode, attach_recurrent, recurrent_layers
from memctl.controller.replay import Capture, Replayer
from memctl.controller.state import STATE_VERSION, validate_state
from memctl.controller.stats import LayerState, LayerStep, ScalarRead, median_grad_sq, start_read
from memctl.controller.update_metric import UpdateMetric
from memctl.errors import ConfigError

if TYPE_CHECKING:
    from memctl.api.server import ServerHandle
    from memctl.monitor import Sampler

__all__ = ["Controller"]

_log = logging.getLogger("memctl.controller")

_SMALL_HINT_BYTES = 1 << 20
"""Least bytes in small tensors for NOTE [ Small tensors kept as they are ]'s hint."""

_STEP_TWICE = (
    "memctl: Controller.step() was called after optimizer.step() had already advanced the "
    "controller (a controller made with an optimizer steps with it); this call and later ones "
    "like it are ignored. Remove the ctl.step() call, or make the Controller without the "
    "optimizer and keep it (NOTE [ One boundary per step ])."
)


def _hookable(optimizer: torch.optim.Optimizer | None) -> torch.optim.Optimizer | None:
    """The optimizer whose step hooks fire: ``optimizer``, or the one it wraps (NOTE
    [ Wrapped optimizers ])."""
    outer = optimizer
    for _ in range(4):
        if optimizer is None or hasattr(optimizer, "_optimizer_step_post_hooks"):
            return optimizer
        inner = getattr(optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            break
        optimizer = inner
    raise ConfigError(
        f"optimizer {type(outer).__name__} has no step hooks (it does not run "
        "torch.optim.Optimizer.__init__) and wraps no optimizer that has them as .optimizer; pass "
        "the torch.optim.Optimizer it wraps, or pass optimizer=None and call ctl.step() after each "
        "optimizer step")


_TRAIN_EVERY = 8
"""Most steps between two reads of the training gradient's ‖ĝ‖² (NOTE [ Gradient scale between
probes ]); the steps that gather the layers' statistics read it too."""


class Controller:
    """Runtime memory manager for one model and optimizer.

    >>> ctl = memctl.Controller(model, optimizer, budget="12GiB")   # doctest: +SKIP
    >>> for x, y in loader:                                          # doctest: +SKIP
    ...     loss_fn(model(x), y).backward()
    ...     optimizer.step(); optimizer.zero_grad()                  # the controller steps here
    >>> ctl.stats()["ratio"]                                         # doctest: +SKIP

    Args:
        model: the user's module; its layers and weights are never replaced.
        optimizer: its ``step`` advances the controller (post-hook). Without one, call
            :meth:`step` after each optimizer step yourself.
        budget: device-memory target: bytes, ``"12GiB"``, ``"75%"`` of the device, or
            ``None`` (no limit).
        bits: average bits per compressed value when there is no budget. With neither
            ``bits`` nor ``budget`` the controller keeps the fewest bytes whose added
            gradient variance stays under ``variance_bound`` of the minibatch gradient's
            own (NOTE [ Default policy ]). Every policy is guarded (NOTE [ Convergence guard ]).
        config: a full :class:`ControllerConfig`; keyword overrides are applied on top.
        device: the device whose memory the budget is about (default: the model's).
        process_group: the ``torch.distributed`` group whose ranks agree on the allocation,
            batch size and budget (default: the default group once initialised; see
            NOTE [ Agreement across ranks ] in ``distributed.py``). Under a group,
            :meth:`detach` is collective (call it on every rank between the same two
            optimizer steps) and :meth:`load_state_dict` applies at the next step boundary
            on every rank (NOTE [ Leaving the agreement ]).
        **overrides: any :class:`ControllerConfig` field, e.g. ``min_numel=1024``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        budget: object = None,
        bits: float | None = None,
        config: ControllerConfig | None = None,
        device: torch.device | str | None = None,
        process_group: object = None,
        **overrides: Any,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if isinstance(model, torch.jit.ScriptModule):  # NOTE [ TorchScript submodules ] in hooks.py
            raise ConfigError(
                f"model is a TorchScript module ({type(model).__name__}), which takes no forward hooks; "
                "attach the Controller to the eager model (script it after training, or script "
                "submodules only: those are left unhooked)")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(
                f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}"
            )
        optimizer = _hookable(optimizer)  # NOTE [ Wrapped optimizers ]
        managed = managing_hooks(model)
        if managed:
            raise ConfigError(
                f"{type(model).__name__} already has a memctl.Controller attached (hooks on "
                f"{', '.join(managed[:3])}{', ...' if len(managed) > 3 else ''}); two controllers on one "
                "model would split its saved tensors between them: keep using the first, or call its "
                "detach() before attaching another"
            )
        base = config if config is not None else ControllerConfig()
        if bits is not None:
            overrides["bits"] = bits
        if overrides:
            fields = base.__dataclass_fields__
            unknown = sorted(set(overrides) - set(fields))
            if unknown:
                raise ConfigError(f"unknown Controller option(s) {unknown}; known: {sorted(fields)}")
            base = ControllerConfig(**{**{f: getattr(base, f) for f in fields}, **overrides})
        self.config = base
        self.model = model
        self.optimizer = optimizer
        self.device = resolve_device(device, model)
        self._budget_spec: BudgetSpec | None = parse_budget(budget)
        self._lock = threading.Lock()
        self._pending: list[BudgetSpec | None] = []
        self._events: deque[dict[str, Any]] = deque(maxlen=self.config.max_events)
        self._event_counts: dict[str, int] = {}
        self._layers: dict[str, LayerState] = {}
        self._step = 0
        self._warmup_choice = (float(max(self.config.bit_choices)), None)  # NOTE [ Warm-up ]
        self._fallbacks = 0
        self._fallback_layers: set[str] = set()
        self._errors = 0
        self._micro_batches = 0
        self._batch_size: int | None = None
        self._oom_cap: int | None = None
        self._static_bytes = 0
        self._device_total = memory.device_total_bytes(self.device)
        resolve_budget(self._budget_spec, self._device_total)  # refuses too large a budget before any hook
        self._activation_budget: int | None = None
        self._allocation: dict[str, Any] | None = None
        self._attribution_lost = False
        self._small_hinted = False  # NOTE [ Small tensors kept as they are ]
        self._default_choice: dict[bool, tuple[float, float | None]] = {}
        """:meth:`_choice_for` of a layer without an allocation, with and without a budget."""
        self._probing = True
        self._calls_at_open = 0
        self._budget_changed = False
        self._totals: dict[str, Any] = {"raw_bytes": 0, "packed_bytes": 0, "other_bytes": 0}
        self._tracker = ModuleTracker()
        self._recurrent = RecurrentMode()
        self._packer = Packer(self.config, self._tracker, self._choice_for, self._on_fallback)
        self._tracker.on_exit = self._packer.observe
        self._tracker.on_entry = self._on_entry
        self._entered = False
        self._packer.set_parameters(model)
        self._scope = SavedTensorScope(self._packer.pack, self._packer.unpack, self._capturing)
        self._handles: list[Any] = []
        self._server: ServerHandle | None = None
        self._monitor: Sampler | None = None
        self._snapshot: Mapping[str, Any] = MappingProxyType({})
        self._publication = Publication(self._publish, self.config.allocation_interval,
                                        self._settle_statistics)
        group = resolve_group(process_group) if self.config.sync_ranks else None
        self._ranks: RankSync | None = RankSync(group) if group is not None else None
        if self._ranks is not None and self._ranks.world_size < 2:
            self._ranks = None
        self._calibration = Calibration(self.config)
        self._metric = UpdateMetric(optimizer, enabled=self.config.variance_metric == "update")
        """NOTE [ Update metric ]."""
        self._replayer = Replayer(self.config, self._tracker, self.device,
                                  walking=lambda: self._packer.walking, metric=self._metric)
        self._guard = ConvergenceGuard(self.config.guard_tolerance, self.config.bit_choices)
        self._gates = GateFloors(model, self.config.gate_bits) if self.config.gate_bits is not None else None
        """NOTE [ Gates near zero ]."""
        self._gate_floors: dict[str, float] = {}
        self._recurrent_layers = recurrent_layers(model)  # NOTE [ No 1 bit for a recurrent layer ]
        self._bottlenecks = bottleneck_layers(model, self.config.bottleneck_bits)
        """NOTE [ Bottleneck inputs ] in bottlenecks.py."""
        self._capture: Capture | None = None
        self._trained_at = -_TRAIN_EVERY
        """The last step whose training gradient's ‖ĝ‖² was read (NOTE [ Gradient scale between probes ])."""
        self._unfolded: tuple[ScalarRead, dict[str, LayerStep], int | None] | None = None
        """The last boundary's statistics while read late (NOTE [ Statistics read a step late ]): the
        read, its records, and the step whose ‖ĝ‖² it holds (None: it holds none)."""
        self._leaving = False
        self._stepped_by_optimizer = False
        """The optimizer's step hook made the last boundary, and no forward ran since."""
        self._sentinel: torch.Tensor | None = None
        """A parameter of the optimizer's whose gradient is watched (NOTE [ Skipped optimizer steps ])."""
        self._grad_arrived = False
        self._skip_reported = False
        self._step_warned = False
        self._leave_handle: Any = None
        self._await_output = False
        self._replaying = False
        self._guard_fired = False
        self._train_s = 0.0
        self._last_boundary = time.perf_counter()
        self._attach()
        self._publish()

    # -- attach / detach ---------------------------------------------------------------
    def _attach(self) -> None:
        model = self.model
        # NOTE [ Copies of an attached model ]: every hook is a ControllerHook.
        on_forward, on_end = ControllerHook(self._on_forward), ControllerHook(self._on_forward_end)
        self._handles.append(model.register_forward_pre_hook(on_forward, with_kwargs=True))
        self._handles.append(model.register_forward_hook(on_end, always_call=True))
        self._handles.extend(self._tracker.attach(model))
        if self.config.fused_rnn:  # NOTE [ Fused recurrent layers ]
            self._handles.extend(attach_recurrent(model, self._recurrent))
        self._handles.extend(self._packer.fsdp.attach(model))
        for name, module in hookable_modules(model):  # NOTE [ TorchScript submodules ] in hooks.py
            if module is model or not any(True for _ in module.parameters(recurse=False)):
                continue
            self._layers.setdefault(name, LayerState(name=name, kernel=_kernel_size(module)))
            self._handles.append(module.register_forward_hook(ControllerHook(self._grad_probe(name))))
        if self.optimizer is not None:
            self._handles.append(self.optimizer.register_step_post_hook(ControllerHook(self._on_optimizer_step)))
            self._sentinel = next((p for g in self.optimizer.param_groups for p in g["params"]
                                   if isinstance(p, torch.Tensor) and p.requires_grad and p.is_leaf), None)
            if self._sentinel is not None:  # NOTE [ Skipped optimizer steps ]
                self._handles.append(self._sentinel.register_post_accumulate_grad_hook(
                    ControllerHook(self._on_sentinel_grad)))
        self._refresh_gates()
        if self.config.monitor_interval_s > 0:
            from memctl.monitor import Sampler, select_reader

            reader = select_reader(self.device, activation_bytes_fn=self._live_activation_bytes)
            self._monitor = Sampler(
                reader, interval_s=self.config.monitor_interval_s, capacity=self.config.monitor_history
            )
            self._monitor.start()
        self._event("attach", f"attached to {type(model).__name__} on {self.device}; "
                    f"budget {self._budget_text()}")
        if self._packer.fsdp.active and self._calibration.enabled:
            self._event("calibration_off", "calibration probes are off under FSDP2 (a replay would run "
                        "FSDP's collectives); the closed-form variance model is used "
                        "(NOTE [ Calibration across ranks ])")

    def detach(self) -> None:
        """Remove every hook and stop the monitor and server: the model is plain PyTorch again.

        Under a process group this is collective: call it on every rank between the same
        two optimizer steps. The optimizer's step hook stays for one more step, whose
        boundary tells the other ranks this one left (NOTE [ Leaving the agreement ]);
        without an optimizer call :meth:`step` once more instead.
        """
        self._scope.close()
        self._packer.collector.resume()
        if self._handles and self._ranks is not None and not self._ranks.left:
            self._leaving = True
            if self.optimizer is not None:
                hook = ControllerHook(self._on_leave_step)
                self._leave_handle = self.optimizer.register_step_post_hook(hook)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._tracker.reset()
        self._packer.fsdp.detach()
        if self._gates is not None:
            self._gates.close()
        settle_checks()  # NOTE [ Exception lists without a wait ]: no input is held past the detach
        self._settle_statistics()
        if self._monitor is not None:
            self._monitor.close()
            self._monitor = None
        if self._server is not None:
            self._server.close()
            self._server = None
            self._publication.serving = False

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def _on_leave_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._leave()

    def _leave(self) -> None:
        """The boundary of a detached rank: NOTE [ Leaving the agreement ]."""
        ranks, self._leaving = self._ranks, False
        if self._leave_handle is not None:
            self._leave_handle.remove()
            self._leave_handle = None
        if ranks is None or ranks.left:
            return
        k = self.config.allocation_interval
        due = self._budget_changed or ranks.budget_pending or self._allocation is None or self._step % k == 0
        try:
            ranks.leave(self, due)
        except Exception as exc:  # NOTE [ Errors at the step boundary ]
            _log.error("memctl could not tell the other ranks this one left (%s: %s)",
                       type(exc).__name__, exc)
        self._event("ranks", f"left the agreement across ranks at step {self._step} (detached)")
        self._ranks = None

    def __enter__(self) -> Controller:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.detach()

    # -- hooks ------------------------------------------------------------------------
    @torch.compiler.disable
    def _on_forward(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._replaying or not torch.is_grad_enabled():
            return
        if self._grad_arrived and self._tracker.model_depth == 0 and self._sentinel is not None \
                and self._sentinel.grad is None and self._scope.is_open:
            self._skipped_step()  # NOTE [ Skipped optimizer steps ]
        if self._open_window():
            if self._calibration_due():
                self._capture = self._replayer.capture(args, kwargs)
                self._await_output = True
        elif self._tracker.model_depth == 0:
            self._scope.to_top()  # NOTE [ Two controllers ] in hooks.py
        if self._tracker.model_depth == 0:
            self._stepped_by_optimizer = False  # NOTE [ One boundary per step ]
            first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
            samples = 0
            if first is not None and first.dim() > self.config.batch_dim:
                samples = int(first.shape[self.config.batch_dim])
            self._packer.begin_forward(samples)  # NOTE [ Micro-batches ]
            self._packer.collector.forward()  # NOTE [ Collector paused while records live ]
            if self.config.keep_inputs:
                self._packer.inputs.set((*args, *kwargs.values()))  # NOTE [ Model inputs ]
        self._tracker.model_depth += 1

    def _capturing(self) -> bool:
        """Whether the pack hook compresses the tensor at hand (NOTE [ Capture window ])."""
        return self._tracker.current != ROOT or self._packer.graph_alive

    @torch.compiler.disable
    def _on_forward_end(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._replaying:
            return
        if self._tracker.model_depth > 0:
            self._tracker.model_depth -= 1
        self._packer.observe(output)
        if self._tracker.model_depth == 0:
            # The model's forward is over (or raised): drop the inputs still waiting for the op
            # that saved them, which would otherwise keep this forward's graph alive
            # (NOTE [ Finding the op that saved a tensor ]).
            self._packer.end_forward(output)  # NOTE [ The head's input ]: the head from the outputs
        if self._await_output and self._tracker.model_depth == 0 and self._capture is not None:
            self._await_output = False
            self._replayer.watch_outputs(self._capture, output)

    def begin_step(self) -> None:
        """Open the capture window now (NOTE [ Capture window ]); a no-op while it is open.

        For trainers whose training step does not call the model's own ``forward`` (a
        LightningModule's ``training_step`` calling ``self.net(x)``): call this before the
        step's forward. The optimizer's step closes the window as usual.
        """
        if torch.is_grad_enabled() and not self._open_window():
            self._scope.to_top()  # NOTE [ Two controllers ] in hooks.py

    def _open_window(self) -> bool:
        """Open the capture window and start the packer's step; False when it was open already."""
        if not self._scope.open():
            return False
        self._packer.begin_step(self._step, ranging=self._probing)
        self._tracker.reset()
        self._calls_at_open = self._tracker.module_calls
        return True

    def _on_entry(self, name: str, args: Any) -> None:
        """A submodule's forward outside the model's (NOTE [ Forwards that enter below the
        model ] in hooks.py)."""
        if self._replaying or not torch.is_grad_enabled() or torch._C._current_autograd_node() is not None:
            return  # (in a backward: a checkpointed region's recomputation)
        if not self._entered:
            self._entered = True
            _log.info("memctl: submodule %r ran outside the model's own forward; its forward opens the "
                      "capture window (no batch count and no calibration probes for such forwards)", name)
            self._event("entry", f"forward entered below the model at {name!r}")
        self.begin_step()
        if self.config.keep_inputs:
            self._packer.inputs.set(args)  # NOTE [ Model inputs ] in inputs.py

    def _grad_probe(self, name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if (not self._probing or self._replaying or torch.compiler.is_compiling()
                    or not torch.is_grad_enabled()):
                return
            out = _first_tensor(output)
            if out is None or not out.requires_grad or not out.is_floating_point():
                return
            record = self._packer.record(name)

            def on_grad(g: torch.Tensor) -> None:
                flat = g.detach().reshape(-1)
                flat = flat if flat.dtype is torch.float32 else flat.float()
                record.grad_sq.append(torch.dot(flat, flat))  # one op and one pass (square().sum(): two)

            out.register_hook(on_grad)

        return hook

    def _on_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._advance()
        self._stepped_by_optimizer = True

    def _on_fallback(self, layer: str, exc: BaseException) -> None:
        self._fallbacks += 1
        if layer not in self._fallback_layers:
            self._fallback_layers.add(layer)
            _log.warning("codec failed on layer %r (%s: %s); keeping that tensor uncompressed",
                         layer, type(exc).__name__, exc)
            self._event("codec_fallback", f"layer {layer!r}: {type(exc).__name__}: {exc}")
        else:
            _log.debug("codec fallback on layer %r: %s", layer, exc)

    def _choice_for(self, layer: str) -> tuple[float, float | None]:
        if self._step < self.config.warmup_steps and self._budget_spec is None:  # NOTE [ Warm-up ]
            return self._warmup_choice
        state = self._layers.get(layer)
        if state is None or state.bits is None:
            # the same for every such layer while the budget is set or not (the config is frozen):
            # worked out once each way, since the pack hook asks for every tensor it quantises
            budgeted = self._budget_spec is not None
            choice = self._default_choice.get(budgeted)
            if choice is None:
                adaptive = policy.resolve_objective(self.config, budgeted) is Objective.BYTES
                bits = float(policy.default_bits(self.config, adaptive))
                choice = self._default_choice[budgeted] = (bits, None)
            # NOTE [ Gates near zero ]; NOTE [ Bottleneck inputs ] in bottlenecks.py
            for floors in (self._gate_floors, self._bottlenecks):
                floor = floors.get(layer) if floors else None
                if floor is not None and floor > choice[0]:
                    return floor, None
            return choice
        return state.bits, state.error_bound

    # -- the step boundary -----------------------------------------------------------
    def step(self) -> None:
        """Advance one step: call it after each optimizer step when the controller was made
        without an optimizer; with one, its step post-hook does it, and a call here after
        that step (before the model's next forward) is ignored with a warning once (NOTE
        [ One boundary per step ]).

        Never raises (NOTE [ Errors at the step boundary ]): an error in the statistics,
        policy or allocation code is logged, counted in ``stats()["errors"]`` and recorded
        as an event; the step still advances and training goes on at the last good
        allocation.
        """
        if self._stepped_by_optimizer:
            if not self._step_warned:
                self._step_warned = True
                _log.warning(_STEP_TWICE)
                warnings.warn(_STEP_TWICE, RuntimeWarning, stacklevel=2)
            return
        self._advance()

    def _on_sentinel_grad(self, param: torch.Tensor) -> None:
        self._grad_arrived = True  # NOTE [ Skipped optimizer steps ]

    def _skipped_step(self) -> None:
        """The gradients were cleared after a backward with no optimizer step between: the
        step was skipped (NOTE [ Skipped optimizer steps ])."""
        if not self._skip_reported:
            self._skip_reported = True
            _log.info("memctl: the gradients were cleared without an optimizer step (a step skipped by "
                      "a gradient scaler?); the controller advances at such steps as at optimizer steps")
            self._event("skipped_step", "gradients cleared without an optimizer step: the controller "
                        "advanced as at an optimizer step")
        self._capture = None  # no probe from inside the model's forward pre-hook
        self._await_output = False
        self._advance()

    def _advance(self) -> None:
        self._grad_arrived = False
        start = self._step
        if self._leaving:
            self._leave()
            return
        try:
            self._step_boundary()
        except Exception as exc:
            self._step_failed(exc, start)

    def _step_failed(self, exc: Exception, start: int) -> None:
        """NOTE [ Errors at the step boundary ]."""
        self._errors += 1
        _log.error("memctl step boundary failed at step %d (%s: %s); training goes on at the last "
                   "good allocation", start, type(exc).__name__, exc, exc_info=exc)
        try:
            self._event("error", f"step boundary failed: {type(exc).__name__}: {exc}")
            self._scope.close()
            self._packer.finish_step()
            self._packer.set_parameters(self.model)
            if self._step == start:
                self._step += 1
            self._probing = True
            self._publish()
        except Exception:  # the snapshot keeps its last good value
            _log.exception("memctl could not publish its state after the step boundary failed")

    def _step_boundary(self) -> None:
        started = time.perf_counter()
        self._settle_statistics()  # the last step's (NOTE [ Statistics read a step late ])
        if self._gates is not None and self._gates.watching:
            self._gates.finish()  # before any replay runs the model (NOTE [ Gates near zero ])
        self._scope.close()
        self._packer.collector.resume()
        self._train_s += time.perf_counter() - self._last_boundary
        records = self._packer.finish_step()
        batch = self._packer.last_samples
        self._micro_batches = self._packer.last_micro_batches
        self._attribution_lost = bool(records) and set(records) <= {ROOT, MODEL} and any(
            True for m in self.model.modules() if m is not self.model
        ) and self._tracker.module_calls == self._calls_at_open
        if not self._small_hinted and records:
            self._hint_small_tensors(records)
        for state in self._layers.values():
            if state.name not in records:
                state.raw_bytes = state.packed_bytes = state.fixed_bytes = state.other_bytes = 0
                state.mask_bytes = 0
                state.numels = ()
                state.used_bits = None
        cal = self._calibration
        steps = list(records.values())
        # NOTE [ Gradient scale between probes ]: the training gradient's ‖ĝ‖², in the same read-back,
        # at the steps that gather the layers' statistics (``_probing``) and every few steps between
        sample = self._probing or self._step - self._trained_at >= _TRAIN_EVERY
        trained = (self._training_grad_sq() if cal.enabled and records and sample
                   and not self._packer.fsdp.active else [])
        if trained:
            self._trained_at = self._step
            steps.append(LayerStep(grad_sq=list(trained)))
        # one read-back (NOTE [ One read-back per step ]), on a GPU folded late
        # (NOTE [ Statistics read a step late ])
        read = start_read(steps, defer=self._ranks is None)
        decay = self.config.ema_decay
        for name, rec in records.items():
            layer = self._layers.get(name)
            if layer is None:
                layer = self._layers[name] = LayerState(name=name)
            layer.update(rec, batch=batch, decay=decay, later=True)
        self._unfolded = (read, records, self._step if trained else None)
        if read.done():
            self._settle_statistics()
        raw_bytes = packed_bytes = other_bytes = 0
        for s in self._layers.values():
            if s.raw_bytes or s.other_bytes:
                raw_bytes += s.raw_bytes
                packed_bytes += s.packed_bytes
                other_bytes += s.other_bytes
        self._totals = {"raw_bytes": raw_bytes, "packed_bytes": packed_bytes, "other_bytes": other_bytes,
                        "batch": batch}
        saved = self._totals["packed_bytes"] + self._totals["other_bytes"]
        ranks = self._ranks
        self._budget_changed |= self._apply_pending() if ranks is None else ranks.apply_budget(self)
        # Under a process group the probe and the guard run at the allocation step, agreed
        # across ranks (NOTE [ Calibration across ranks ]), so every rank takes the branches
        # below alike.
        guarded = self._calibrate_and_guard() if records and ranks is None else False
        solved = False
        due = self._budget_changed or self._allocation is None or guarded or (
            self._step % self.config.allocation_interval == 0)
        if due or ranks is not None:
            self._settle_statistics()
        if due:
            # Static memory only feeds the allocation: measured when it runs, not every step
            # (it walks every parameter, gradient and optimizer state tensor).
            self._static_bytes = memory.static_bytes(self.model, self.optimizer, self.device, saved)
        # With ranks, every rank takes this branch alike (NOTE [ Agreement across ranks ]).
        share = share_probe(self) if ranks is not None and due else None
        if (records or ranks is not None) and due and (ranks is None or ranks.reduce_statistics(self, share)):
            if share is not None and share.received:
                guarded = apply_share(self, share)
            reason = "budget change" if self._budget_changed else "guard" if guarded else "interval"
            self._reallocate(reason=reason)
            self._budget_changed = False
            solved = True
        self._update_batch_size(batch)
        if ranks is not None and not ranks.left:
            ranks.end_step(self, solved)
        self._packer.refresh_parameters(self.model, full=due)  # NOTE [ Parameter scan ]
        self._step += 1
        if self._step == self.config.warmup_steps and self._budget_spec is None:  # NOTE [ Warm-up ]
            message = (f"warm-up over after {self._step} optimizer steps at {self._warmup_choice[0]:g} "
                       "bits: the allocation's widths apply now")
            _log.info("memctl: %s", message)
            self._event("warmup", message)
        if ranks is not None and ranks.left:  # NOTE [ Leaving the agreement ]
            self._ranks = None
        elif ranks is not None:
            ranks.apply_loaded(self)
        self._probing = self._wants_gradients()
        self._packer.timings.observe_step(time.perf_counter() - started)
        self._publication.boundary()  # NOTE [ Lazy publication ]
        if self._unfolded is not None:  # a read in the training thread folds them first
            self._publication.mark_stale()
        self._last_boundary = time.perf_counter()

    def _refresh_gates(self) -> None:
        """Read the normalisation scales again and floor the layers around those near zero
        (NOTE [ Gates near zero ]); an event when the set of gates changes."""
        gates = self._gates
        if gates is None:
            return
        before, floored = gates.gates, set(self._gate_floors)
        try:
            gates.refresh()
        except Exception as exc:  # NOTE [ Codec fallback ]: a floor never stops training
            _log.warning("memctl could not read the normalisation scales (%s: %s); no gate floors from now "
                         "on (NOTE [ Gates near zero ])", type(exc).__name__, exc)
            gates.close()
            self._gates, self._gate_floors = None, {}
            return
        if gates.gates and not gates.watching:
            gates.watch()
        self._gate_floors = gates.floors()
        if gates.gates != before or set(self._gate_floors) != floored:
            opened = sorted(before - gates.gates)
            # a container whose input is a residual sum is a neighbour too, but holds no records
            kept = (sum(1 for n in self._gate_floors if n in self._layers) if self._layers
                    else len(self._gate_floors))
            message = (f"{len(gates.gates)} residual branches closed by a normalisation scale near zero; "
                       f"{kept} layers kept at >= {gates.bits} bits"
                       + (f" (opened: {', '.join(opened[:4])}{' ...' if len(opened) > 4 else ''})"
                          if opened else ""))
            _log.info("memctl at step %d: %s", self._step, message)
            self._event("gates", message)

    def _settle_statistics(self) -> None:
        """Fold the statistics of the last boundary that were read late, waiting for their copy
        if it has not arrived (NOTE [ Statistics read a step late ])."""
        unfolded, self._unfolded = self._unfolded, None
        if unfolded is None:
            return
        read, records, trained = unfolded
        rows = read.result()
        if trained is not None:
            self._calibration.observe_training(rows.pop()[3], trained)
        decay = self.config.ema_decay
        for (name, rec), row in zip(records.items(), rows, strict=True):
            layer = self._layers.get(name)
            if layer is not None:  # None: a state loaded since replaced the layers
                layer.fold(rec, row, decay=decay)

    def _training_grad_sq(self) -> list[torch.Tensor]:
        """‖g‖² of the gradient the optimizer just stepped with (its parameters' ``.grad``; the
        model's without an optimizer) as float32 scalars to sum, one per device and dtype, each
        one ``_foreach_norm`` (NOTE [ Gradient scale between probes ]), in the metric the probes
        measure in (NOTE [ Update metric ]); empty when they hold none."""
        params = (self.model.parameters() if self.optimizer is None else
                  (p for group in self.optimizer.param_groups for p in group["params"]))
        return self._metric.grad_sq([(p, p.grad.detach()) for p in params if p.grad is not None
                                     and p.grad.layout is torch.strided and type(p.grad) is torch.Tensor])

    def observe_loss(self, loss: torch.Tensor | float) -> None:
        """Give the convergence guard this step's loss (optional; NOTE [ Convergence guard ]).

        Call it once per step, before or after the optimizer step. A tensor is read back
        (one device synchronisation); pass ``loss.item()`` if you already have it.
        """
        value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
        self._guard.observe_loss(value)

    def _calibration_due(self) -> bool:
        # Under FSDP2 a replay would run FSDP's collectives (NOTE [ Calibration across ranks ]).
        if not self._calibration.enabled or self._packer.fsdp.active:
            return False
        k = self.config.allocation_interval
        if not (self._step % k == 0 or self._allocation is None):
            return False
        # One process skips a probe until its time budget allows it (NOTE [ Probe cost ]);
        # ranks must all probe at the same steps.
        return self._ranks is not None or self._calibration.affords(self._train_s)

    def _calibrate_and_guard(self) -> bool:
        """Run a due calibration probe and the convergence guard; True if the guard raised bits."""
        capture, self._capture = self._capture, None
        self._await_output = False
        if capture is not None or (self.config.guard and self._guard.loss_turning(self._step)):
            self._settle_statistics()  # the probe and the guard use this step's statistics
        layers = [s for s in self._layers.values() if s.numels]
        fired = self._guard_fired = False
        result: ProbeResult | None = None
        if capture is not None and capture.out_grads and layers:
            self._replaying = True
            try:
                # a probe takes the median over every layer that has a ‖∇Y‖² now, and keeps
                # those layers for the medians after it (NOTE [ The median's layers ])
                result = run_probe(replay_module(self.model), self._replayer, capture, self._calibration,
                                   layers, self._choice_for, self.config, median_grad_sq(layers), self._step,
                                   self._train_s)
            except Exception as exc:  # NOTE [ Codec fallback ]: calibration never stops training
                _log.warning("calibration probe failed at step %d (%s: %s); calibration is off from now on",
                             self._step, type(exc).__name__, exc)
                self._event("calibration_failed", f"{type(exc).__name__}: {exc}")
                self._calibration.disable()
            finally:
                self._replaying = False
                self._tracker.reset()
            self._train_s = 0.0
            if result is not None and result.restarted is not None:
                self._metric_restarted(result.restarted)
        fallback_g2 = self._calibration.median_grad_sq(layers)  # after the probe: over its layers
        if result is not None and result.unsafe:  # NOTE [ Robust measurements ]
            self._outlier_event(result.unsafe, "")
        if result is not None and self.config.guard:
            fired = self._noise_guard(result.added, layers, fallback_g2)
            if not fired and result.tail:
                fired = self._tail_guard(layers, fallback_g2, "")
        if self.config.guard and not fired and self._guard.loss_turning(self._step):
            fired = self._raise_bits(layers, fallback_g2, 0.5, "the loss turned back up against its history")
        self._guard_fired = fired
        return fired

    def _metric_restarted(self, before: str) -> None:
        """The probe measured in another metric than the values kept (a state saved with the
        other one, or another optimizer): those were dropped (NOTE [ Update metric ])."""
        self._event("calibration_metric", f"calibration restarted in the {self._calibration.metric} metric: "
                    f"what was measured in the {before} metric does not compare")

    def _outlier_event(self, unsafe: Iterable[tuple[str, int]], where: str) -> None:
        """Report the (layer, bits) pairs that gave an absurd draw (NOTE [ Robust measurements ]);
        ``where``: added after the pairs (" (on at least one rank)" under a process group)."""
        self._event("calibration_outlier", "absurd added variance measured for "
                    + ", ".join(f"{n} at {b} bits" for n, b in unsafe)
                    + f"{where}; those widths are kept from those layers")

    def _tail_guard(self, layers: list[LayerState], fallback_g2: float, where: str) -> bool:
        """Raise bits after a replay of the allocation in use gave an absurd gradient."""
        return self._raise_bits(layers, fallback_g2, 1.0, f"a replay of the allocation in use gave an absurd "
                                f"gradient{where} (NOTE [ Robust measurements ])")

    def _noise_guard(self, added: float | None, layers: list[LayerState], fallback_g2: float) -> bool:
        reference = self._calibration.reference()
        # also at the first probe, before any allocation: the first steps run at the
        # configured bits, which the calibration has only now measured
        if added is None or reference is None:
            return False
        objective = policy.resolve_objective(self.config, self._budget_spec is not None)
        predicted = self._calibration.added_predicted
        if objective is Objective.BYTES:
            # The re-solve that follows uses this probe's measurements; the guard acts only
            # where the calibrated model itself misses the measured total by more than 2x.
            threshold = 2.0 * self.config.variance_bound * reference
            if predicted is not None and added <= 2.0 * predicted:
                return False
        else:
            threshold = self.config.guard_bound * reference
        if added <= threshold:
            return False
        why = (f"measured added gradient variance {added:.3g} exceeds the bound {threshold:.3g} "
               f"({added / reference:.2%} of the minibatch gradient's own variance)")
        return self._raise_bits(layers, fallback_g2, 1.0 - threshold / added, why)

    def _raise_bits(self, layers: list[LayerState], fallback_g2: float, excess: float, why: str) -> bool:
        noise = [LayerNoise(s.name, self._choice_for(s.name)[0],
                            self._calibration.estimate(s, fallback_g2, self._choice_for(s.name)[0]))
                 for s in layers if self._choice_for(s.name)[0] < KEEP_BITS]
        raised = self._guard.raise_bits(noise, excess, self._step)
        if not raised:
            return False
        what = ", ".join(f"{name} {old:g}->{new:g}" for name, old, new in raised)
        msg = f"{why}; raising bits: {what}"
        _log.warning("convergence guard at step %d: %s", self._step, msg)
        self._event("guard", msg)
        return True

    def _wants_gradients(self) -> bool:
        """Measure ‖∇Y‖² only on steps whose statistics the next allocation uses.

        The squared-norm reductions cost a pass over every output gradient, so they run
        in the first steps and in the last step before each re-solve (or a queued budget
        change), not in every step.
        """
        with self._lock:
            pending = bool(self._pending)
        k = self.config.allocation_interval
        return pending or self._step < 2 or (self._step + 1) % k == 0 or self._step % k == 0

    def _apply_pending(self) -> bool:
        with self._lock:
            if not self._pending:
                return False
            spec = self._pending[-1]
            self._pending.clear()
        self._budget_spec = spec
        self._event("budget", f"budget set to {self._budget_text()} at step {self._step}")
        return True

    def _reallocate(self, reason: str) -> None:
        total = resolve_budget(self._budget_spec, self._device_total)
        layers = [s for s in self._layers.values() if s.numels]
        if total is None:
            self._activation_budget = None
        else:
            margin = int(self.config.margin_fraction * total)
            self._activation_budget = max(total - self._static_bytes - margin, 0)
        fallback_g2 = self._calibration.median_grad_sq(layers)
        fixed = policy.fixed_bytes(list(self._layers.values()))
        calibration = self._calibration

        def variance(state: LayerState, bits: int) -> float:
            return calibration.estimate(state, fallback_g2, bits)

        evidence = {s.name: f for s in layers if (f := calibration.floor(s)) is not None}
        self._refresh_gates()
        # NOTE [ Gates near zero ]; NOTE [ Bottleneck inputs ] in bottlenecks.py
        for floors in (self._gate_floors, self._bottlenecks):
            for name, f in floors.items():
                evidence[name] = max(f, evidence.get(name, f))
        for name in self._recurrent_layers:  # NOTE [ No 1 bit for a recurrent layer ]
            evidence[name] = max(LEAST_BITS, evidence.get(name, LEAST_BITS))
        result = policy.allocate(layers, self.config, self._activation_budget, fallback_g2, fixed,
                                 calibration.reference(), variance_fn=variance,
                                 floors=self._guard.floors, evidence_floors=evidence)
        for state in layers:
            state.bits = result.bits[state.name]
            state.error_bound = result.error_bounds.get(state.name)
        added = result.predicted_variance
        calibration.added_share = (added / calibration.unit() if calibration.grad_sq and added is not None
                                   and math.isfinite(added) and added > 0 else 0.0)
        self._allocation = {
            "step": self._step,
            "reason": reason,
            "solver": result.solver,
            "status": result.status,
            "time_ms": result.time_s * 1e3,
            "objective": result.objective,
            "feasible": result.feasible,
            "predicted_bytes": result.predicted_bytes,
            "policy": result.objective_kind,
            "variance_bound": result.bound,
            "predicted_variance": result.predicted_variance,
        }
        _log.info("allocation at step %d (%s): %s in %.2f ms, %s", self._step, reason,
                  result.solver, result.time_s * 1e3, result.status)
        if not result.feasible and self._activation_budget is not None:
            batch = max(self._totals.get("batch", 0), 1)
            recommended = policy.recommend_batch(result, batch, self._activation_budget)
            kind = "budget_infeasible"
            msg = (
                f"budget {self._budget_text()} cannot be met even at the lowest precision at batch size "
                f"{batch}: activations need {format_bytes(result.min_bytes)} but "
                f"{format_bytes(self._activation_budget)} is left after {format_bytes(self._static_bytes)} "
                f"of static memory; use a batch size of at most {recommended}"
            )
            if result.min_bytes_unguarded <= self._activation_budget:
                kind = "guard_budget"
                msg = (
                    f"budget {self._budget_text()} can only be met at batch size {batch} with bits the "
                    f"convergence guard found to hurt training: the guarded bits need "
                    f"{format_bytes(result.min_bytes)} of activations but "
                    f"{format_bytes(self._activation_budget)} is left; keeping the guarded bits; "
                    f"use a batch size of at most {recommended}"
                )
            self._event(kind, msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=3)
            self._batch_size = recommended
        else:
            self._event("allocation", f"{result.solver}: {result.status}")

    def _update_batch_size(self, batch: int) -> None:
        """Largest batch that fits (an infeasible budget keeps ``_reallocate``'s recommendation)."""
        infeasible = self._allocation is not None and not self._allocation["feasible"]
        if not infeasible and (self._activation_budget is None or batch <= 0):
            self._batch_size = batch if batch > 0 else self._batch_size
        elif not infeasible and self._activation_budget is not None:
            layers = [s for s in self._layers.values() if s.numels or s.fixed_bytes or s.other_bytes]
            per_sample = policy.bytes_per_sample(layers, self.config, batch)
            if per_sample > 0:
                fit = int(self._activation_budget // per_sample)
                self._batch_size = max(self.config.min_batch_size, min(fit, self.config.max_batch_size))
        if self._oom_cap is not None and self._batch_size is not None:
            self._batch_size = min(self._batch_size, self._oom_cap)

    # -- public state ----------------------------------------------------------------
    @property
    def step_count(self) -> int:
        return self._step

    @property
    def batch_size(self) -> int | None:
        """Largest batch that fits the budget at the current allocation (None before a step).

        It counts samples per forward, i.e. per micro-batch with gradient accumulation
        (NOTE [ Micro-batches ]): with 4 micro-batches of 16 per optimizer step the basis
        is 16, and ``stats()["micro_batches"]`` is 4.
        """
        return self._batch_size

    @property
    def budget(self) -> BudgetSpec | None:
        return self._budget_spec

    def set_budget(self, value: object) -> dict[str, Any]:
        """Queue a new budget (any thread); it applies at the next step boundary."""
        return dict(self.request_budget(value))

    def stats(self) -> dict[str, Any]:
        """A plain dict of the last completed step (see the README for every key)."""
        self._publication.refresh()
        return _plain(self._snapshot)

    def abort_step(self) -> None:
        """Drop what the current step saved so far (after an exception in forward/backward)."""
        self._scope.close()
        self._packer.finish_step()
        self._tracker.reset()

    def guarded_step(self, compute_loss: Callable[[Any], torch.Tensor], batch: Any, *,
                     max_splits: int = 6) -> float:
        """One optimizer step that splits the batch on out-of-memory (NOTE [ OOM guard ])."""
        return oom.guarded_step(self, compute_loss, batch, max_splits=max_splits)

    def lower_batch_estimate(self, largest_ok: int) -> None:
        """Cap the batch size after an out-of-memory split (used by the OOM guard)."""
        self._oom_cap = max(1, largest_ok)
        self._batch_size = min(self._batch_size or largest_ok, self._oom_cap)
        self._event("oom", f"out of memory: batch split; batch size capped at {self._oom_cap}")
        self._publish()

    # -- ControllerView (memctl.api.view) ---------------------------------------------
    def snapshot(self) -> Mapping[str, Any]:
        self._publication.refresh()  # NOTE [ Lazy publication ]
        return self._snapshot

    def history(self, limit: int | None = None) -> list[Mapping[str, Any]]:
        if self._monitor is None:
            return []
        return [s.to_dict() for s in self._monitor.history(limit)]

    def budget_info(self) -> Mapping[str, Any]:
        with self._lock:
            pending = self._pending[-1] if self._pending else None
            has_pending = bool(self._pending)
        return {
            "target": self._budget_spec.to_json() if self._budget_spec else None,
            "target_bytes": self._resolve(self._budget_spec),
            "activation_budget_bytes": self._activation_budget,
            "pending": (pending.to_json() if pending else None) if has_pending else None,
            "device_total_bytes": self._device_total,
        }

    def request_budget(self, value: object) -> Mapping[str, Any]:
        spec = parse_budget(value)
        target_bytes = self._resolve(spec)
        with self._lock:
            self._pending.append(spec)
        return {
            "target": spec.to_json() if spec else None,
            "target_bytes": target_bytes,
            "applies_at_step": self._step + (1 if self._ranks is None else 2),
            "status": "pending",
        }

    def serve(self, host: str = "127.0.0.1", port: int = 0, *, token: str | None = None,
              port_per_rank: bool = False, **options: Any) -> ServerHandle:
        """Serve the HTTP API in a daemon thread; returns a handle with ``.url`` and ``.close()``.

        With ``port_per_rank=True`` (and a port other than 0) each process of a node binds
        ``port + LOCAL_RANK``, so every rank of a torchrun job can serve. ``options`` go to
        :func:`memctl.api.serve` (``allowed_hosts``, ``token_for_reads``,
        ``request_timeout_s``, ...).
        """
        from memctl.api.server import serve

        if port_per_rank and port:
            port += local_rank()
        if self._server is not None:
            self._server.close()
        self._server = serve(self, host=host, port=port, token=token,
                             history_capacity=self.config.monitor_history, **options)
        self._event("serve", f"HTTP API at {self._server.url}")
        self._publication.serving = True  # NOTE [ Lazy publication ]
        self._publication.refresh()
        return self._server

    # -- state ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs: bits, statistics, budget and step."""
        self._settle_statistics()
        return {
            "version": STATE_VERSION,
            "step": self._step,
            "budget": self._budget_spec.to_json() if self._budget_spec else None,
            "layers": {name: s.state_dict() for name, s in self._layers.items()},
            "batch_size": self._batch_size,
            "oom_cap": self._oom_cap,
            "static_bytes": self._static_bytes,
            "activation_budget": self._activation_budget,
            "fallbacks": self._fallbacks,
            "errors": self._errors,
            "allocation": dict(self._allocation) if self._allocation else None,
            "calibration": self._calibration.state_dict(),
            "guard": self._guard.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from :meth:`state_dict`: all checked first, then applied at once
        (NOTE [ Atomic state restore ]); a rejected state leaves the controller unchanged.

        Under a process group the checked state is applied at the end of the next step
        boundary, on every rank at once: a state loaded on one rank (rank 0 resuming the
        job) is sent to the others, and of states loaded on several ranks the lowest
        rank's wins (NOTE [ Leaving the agreement ]).
        """
        checked = self._checked_state(state)
        if self._ranks is not None and not self._ranks.left:
            self._ranks.queue_load(_plain(state))
            self._event("load_state", f"state queued at step {self._step}; applied on every rank at the "
                        "next step boundary")
            self._publish()
            return
        self._apply_state(checked)

    def _checked_state(self, state: Mapping[str, Any]) -> tuple[Any, Calibration, ConvergenceGuard]:
        valid = validate_state(state)
        calibration, guard = Calibration(self.config), ConvergenceGuard(
            self.config.guard_tolerance, self.config.bit_choices)
        try:
            calibration.load_state_dict(dict(state.get("calibration") or {}))
            guard.load_state_dict(dict(state.get("guard") or {}))
        except (TypeError, ValueError, IndexError) as exc:
            raise ConfigError(
                f"controller state has an invalid 'calibration' or 'guard' entry ({exc}); "
                "pass a state_dict() saved by memctl, or drop those keys to start them afresh"
            ) from None
        return valid, calibration, guard

    def _apply_state(self, checked: tuple[Any, Calibration, ConvergenceGuard]) -> None:
        valid, calibration, guard = checked
        self._unfolded = None  # the loaded statistics replace the last step's
        self._step = valid.step
        self._budget_spec = valid.budget
        self._layers = valid.layers
        self._batch_size = valid.batch_size
        self._oom_cap = valid.oom_cap
        self._static_bytes = valid.static_bytes
        self._activation_budget = valid.activation_budget
        self._fallbacks = valid.fallbacks
        self._errors = valid.errors
        self._allocation = valid.allocation
        self._calibration, self._guard = calibration, guard
        self._event("load_state", f"state restored at step {self._step}")
        self._publish()

    # -- internals --------------------------------------------------------------------
    def _resolve(self, spec: BudgetSpec | None) -> int | None:
        return resolve_budget(spec, self._device_total)

    def _budget_text(self) -> str:
        if self._budget_spec is None:
            if self.config.bits is None:
                return (f"none (adaptive: fewest bytes within {self.config.variance_bound:g} of the "
                        "gradient's own variance)")
            return f"none (average {self.config.bits:g} bits per value)"
        return f"{self._budget_spec.text} ({format_bytes(self._resolve(self._budget_spec))})"

    def _hint_small_tensors(self, records: Mapping[str, Any]) -> None:
        """NOTE [ Small tensors kept as they are ]: say once when tensors under ``min_numel``
        values hold most of a step's activation bytes."""
        small = raw = 0
        for r in records.values():
            small += r.small_bytes
            raw += r.raw_bytes
        if small < _SMALL_HINT_BYTES or 2 * small < raw:
            return
        self._small_hinted = True
        msg = (f"{100.0 * small / raw:.0f}% of the activation bytes saved at step {self._step} "
               f"({format_bytes(small)}) are in tensors under min_numel={self.config.min_numel} values, "
               "kept as they are (a Python loop over time steps saves many small tensors); pass a "
               "lower min_numel (e.g. Controller(..., min_numel=1024)) to compress them, at more "
               "Python cost a step")
        self._event("small_tensors", msg)
        _log.warning("%s", msg)

    def _event(self, kind: str, message: str) -> None:
        self._events.append({"step": self._step, "time": time.time(), "kind": kind, "message": message})
        self._event_counts[kind] = self._event_counts.get(kind, 0) + 1
        self._publication.changed = True

    def _live_activation_bytes(self) -> int:
        return int(self._totals.get("packed_bytes", 0)) + int(self._totals.get("other_bytes", 0))

    def _publish(self) -> None:
        layers = sorted(self._layers.values(), key=lambda s: s.name)
        g2 = self._calibration.median_grad_sq([s for s in layers if s.numels])  # the allocation's median
        raw, packed = self._totals["raw_bytes"], self._totals["packed_bytes"]
        controlled = sum(sum(s.numels) for s in layers if s.used_bits is not None)
        bits_sum = sum(sum(s.numels) * s.used_bits for s in layers if s.used_bits is not None)
        memory_sample = self._monitor.latest() if self._monitor is not None else None
        snap = {
            "step": self._step,
            "budget": self._budget_spec.to_json() if self._budget_spec else None,
            "budget_bytes": self._resolve(self._budget_spec) if self._budget_spec else None,
            "activation_budget_bytes": self._activation_budget,
            "static_bytes": self._static_bytes,
            "raw_bytes": raw,
            "packed_bytes": packed,
            "other_bytes": self._totals["other_bytes"],
            "ratio": raw / packed if packed else (1.0 if not raw else float("inf")),
            "avg_bits": bits_sum / controlled if controlled else 0.0,
            "batch_size": self._batch_size,
            "fallbacks": self._fallbacks,
            "errors": self._errors,
            "micro_batches": self._micro_batches,
            "codec": self.config.codec.value,
            "attribution": "lost (torch.compile)" if self._attribution_lost else "modules",
            "allocation": dict(self._allocation) if self._allocation else None,
            "events": [dict(e) for e in self._events],
            "counters": {"events": dict(self._event_counts)},
            "timings": self._packer.timings.to_dict(),
            "calibration": {
                "probes": self._calibration.probes,
                "metric": self._calibration.metric,  # NOTE [ Update metric ]
                "grad_sq": self._calibration.grad_sq,
                "grad_variance": self._calibration.grad_noise,
                "added_variance": self._calibration.added,
                "added_variance_predicted": self._calibration.added_predicted,
                "guard_actions": self._guard.actions,
            },
            "memory": memory_sample.to_dict() if memory_sample is not None else None,
            **rank_info(self._ranks),
            "ranks": [dict(r) for r in self._ranks.rows] if self._ranks is not None else [],
            "saved_as_is": {"tensors": self._packer.passed, "fsdp_parameters": self._packer.fsdp_passed},
            "layers": [
                {
                    "name": s.name,
                    "bits": s.used_bits if s.used_bits is not None else s.bits,
                    "next_bits": _effective_bits(s, self.config),
                    "error_bound": s.error_bound,
                    "raw_bytes": s.raw_bytes,
                    "packed_bytes": s.packed_bytes,
                    "other_bytes": s.other_bytes,
                    "floored_bytes": s.floored_bytes,
                    "sensitivity": s.sensitivity(g2),
                    "min": s.vmin,
                    "max": s.vmax,
                    **(self._calibration.report(s, g2) if s.numels else {}),
                    "floor_bits": self._guard.floors.get(s.name),
                }
                for s in layers
                if s.raw_bytes or s.other_bytes or s.bits is not None
            ],
        }
        self._snapshot = MappingProxyType(snap)
        self._publication.published()


def _effective_bits(state: LayerState, config: ControllerConfig) -> float:
    bits = state.bits if state.bits is not None else float(policy.default_bits(config))
    return float(8 * state.element_size) if bits >= KEEP_BITS else float(bits)


def _kernel_size(module: torch.nn.Module) -> int:
    k = getattr(module, "kernel_size", None)
    if isinstance(k, tuple):
        n = 1
        for v in k:
            n *= int(v)
        return n
    if isinstance(k, int):
        return k
    return 1


def _first_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        for item in output:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value

