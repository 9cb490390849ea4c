"""The controller's configuration: a frozen, validated dataclass."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from memctl.allocation.knapsack import Method, Objective
from memctl.errors import ConfigError

__all__ = ["KEEP_BITS", "CodecMode", "ControllerConfig", "Objective"]

# Objective (VARIANCE: ActNN, least added variance within the byte budget; BYTES: AC-GC,
# fewest bytes within a variance bound) is the allocation's own enum, re-exported here.

# Bits that mean "keep the activation uncompressed" in allocations and stats.
KEEP_BITS = 32


class CodecMode(str, enum.Enum):
    """How float activations are compressed.

    ``QUANTIZE``: ActNN-style stochastic quantisation at the layer's bits (unbiased).
    ``ERRORBOUND``: COMET-style deterministic quantisation within the layer's absolute
    error bound; the bound is derived from the bits the allocation picks and the
    layer's typical group range (e = R / (2 (2^b - 1)), docs/design.md, "Bits and error bounds").
    """

    QUANTIZE = "quantize"
    ERRORBOUND = "errorbound"


@dataclass(frozen=True)
class ControllerConfig:
    """Settings of a :class:`memctl.Controller`; every field is checked on construction.

    Attributes:
        bits: average bits per compressed value when there is no budget; ``None`` (the
            default) with no budget is the adaptive policy (NOTE [ Default policy ]).
        bit_choices: bit widths the allocation may pick per layer.
        allow_keep: whether the allocation may keep a layer uncompressed.
        min_numel: float tensors with fewer values than this are kept as they are.
        compress_outside: also compress float tensors saved outside the model's forward
            (the loss); off by default, see NOTE [ What is compressed ].
        log_prob_bits: bits at which log-softmax outputs are stored, as probabilities
            with each group's largest kept exact (NOTE [ Log-probabilities ]); 4 (the
            default) or 8; ``None`` keeps them exact.
        attention_bits: least bits of the query, key and probabilities an attention saves
            (``scaled_dot_product_attention``'s query and key; an explicit attention's
            logits matmul operands and probabilities), whatever their layer's bits; the
            gradient-free floats it saves (the logsumexp) are kept exact. ``None`` turns
            the floor off (NOTE [ Bit floors ] in floors.py).
        attention_value_bits: least bits of the value and output an attention saves
            (``scaled_dot_product_attention``'s value and output; the value operand of an
            explicit attention's ``p @ v``): its backward reads them linearly, not through
            an exponential. ``None``: no floor.
        attention_recompute: an explicit attention's probabilities keep no record of their own
            and are recomputed from its query and key records when the backward reads them, as
            ``scaled_dot_product_attention``'s backward does (NOTE [ Attention probabilities
            recomputed from query and key ] in attention.py); on by default.
        norm_bits: least bits of LayerNorm's and RMSNorm's (fused, or written out as
            ``x * rsqrt(mean(x²) + eps)``) input and output (where the next op saves it);
            ``None``: no floor.
        head_bits: least bits of the inputs of the model's head, the matrix product or
            convolution that makes the logits its output (or its loss) comes from (NOTE [ The
            head's input ] in heads.py); ``None``: no floor.
        gate_bits: least bits of the layers around a residual branch closed by a normalisation
            scale near zero (the scale's own input, the residual sum's reader and the shortcut's
            last layer) while it stays closed (NOTE [ Gates near zero ] in gates.py); ``None``:
            no floor.
        bottleneck_bits: least bits of the input of a linear layer with at least 8 times more
            output features than input features (LoRA's ``B``, an adapter's up-projection:
            NOTE [ Bottleneck inputs ] in bottlenecks.py); ``None``: no floor.
        keep_inputs: save the model's own input tensors by reference instead of compressing
            them (NOTE [ Model inputs ]); on by default.
        fused_rnn: run a CPU ``nn.GRU``/``nn.LSTM``/``nn.RNN`` as one autograd function per layer that
            saves its sequences, not the cell's tensors of every time step (NOTE [ Fused
            recurrent layers ] in recurrent.py); on by default.
        pause_collector: pause Python's automatic garbage collection from a forward's start
            to its backward's end (NOTE [ Collector paused while records live ]); on by
            default, and only while the collector was enabled.
        group_size: values per quantisation group (a norm's records take the largest
            multiple of 8 up to it that divides their rows: NOTE [ Norm rows in groups of
            their own ] in floors.py).
        codec: :class:`CodecMode` for float activations.
        allocation_interval: re-solve the bit allocation every this many steps.
        objective: :class:`Objective` of the allocation; ``None`` (the default): least
            variance under a budget or at ``bits`` average bits, fewest bytes under
            ``variance_bound`` when neither is given (NOTE [ Default policy ]).
        variance_bound: for ``Objective.BYTES``, the bound on added variance relative to
            the minibatch gradient's own variance tr Var(g) as the calibration measures it
            (its squared norm until then; NOTE [ Calibration ]). 0.05 adds what a batch 5%
            smaller adds (NOTE [ Default policy ]).
        variance_metric: ``"gradient"`` (the default): the calibration, the bound and the guard
            measure noise as the gradient's squared norm; ``"update"``: as the optimizer's update
            carries it, each parameter's gradient over the optimizer's own scale (Adam's
            ``√mean v̂ + ε``) when the optimizer keeps one (NOTE [ Update metric ] in
            update_metric.py says what each costs).
        warmup_steps: the controller's first this many optimizer steps (a loaded state's count
            included) save every tensor the allocation controls at the widest of
            ``bit_choices`` (8 bits), whatever the policy picks, unless a budget is set: the
            noise of the first steps, while Adam's second-moment estimate holds a few
            gradients, is the noise that costs (NOTE [ Warm-up ] in policy.py). 0 (the
            default): none. Those steps hold about 4x the activation memory of 2-bit steps.
        calibration_fraction: share of the training time the calibration probes may take
            (NOTE [ Calibration ]); 0 turns calibration off (the closed-form model alone).
        calibration_max_replays: most layer measurements in one probe.
        calibration_groups: measure layers whose errors land in disjoint parameters in one
            replay (NOTE [ Several layers per replay ] in grouping.py). Off by default: layers
            whose records are encoded together when both are compressed (a batch-norm
            chain, NOTE [ Batch-norm outputs recomputed from the input ]) are mismeasured
            together (up to 11x under the truth on the test CNN).
        guard: whether the convergence guard acts (NOTE [ Convergence guard ]).
        guard_bound: under ``bits=`` or a budget, the measured added variance, relative to
            the minibatch gradient's own variance, past which the guard raises bits (0.3:
            what a batch about a quarter smaller adds; policy.py says why).
        guard_tolerance: the loss trend check fires when the smoothed loss climbs back by
            this fraction of the drop so far (losses given to ``observe_loss``).
        solver: how the allocation is searched (:class:`~memctl.allocation.Method`):
            ``"auto"``, the knapsack dynamic program with ``scipy.optimize.milp`` when it
            stops early, or ``"milp"``, HiGHS alone.
        solver_time_limit_s: time limit of the whole allocation solve; past it the best
            answer found so far (at worst the greedy one) is used.
        ema_decay: decay of the exponential moving averages of layer statistics.
        margin_fraction: share of the device budget held back as a safety margin.
        min_batch_size, max_batch_size: limits of the recommended batch size.
        batch_dim: dimension of the model's first input that holds the batch.
        max_events: how many recent events are kept.
        monitor_interval_s: sampling interval of the memory monitor thread (0 disables it).
        monitor_history: number of monitor samples kept.
        codec_impl: which codec implementation runs (``"reference"``, ``"cpu"``,
            ``"cuda"``; ``None``: the Numba kernel for the tensor's device). The PyTorch
            reference needs no JIT compilation, which suits short-lived processes.
        sync_ranks: with a ``torch.distributed`` process group, agree on the allocation,
            batch size and budget across ranks (NOTE [ Agreement across ranks ]).
    """

    bits: float | None = None
    bit_choices: tuple[int, ...] = (1, 2, 4, 8)
    allow_keep: bool = True
    min_numel: int = 4096
    compress_outside: bool = False
    log_prob_bits: int | None = 4
    attention_bits: int | None = 8
    attention_value_bits: int | None = 4
    attention_recompute: bool = True
    norm_bits: int | None = 4
    head_bits: int | None = 4
    gate_bits: int | None = 4
    bottleneck_bits: int | None = 8
    keep_inputs: bool = True
    fused_rnn: bool = True
    pause_collector: bool = True
    group_size: int = 256
    codec: CodecMode = CodecMode.QUANTIZE
    allocation_interval: int = 10
    objective: Objective | None = None
    variance_bound: float = 0.05
    variance_metric: str = "gradient"
    warmup_steps: int = 0
    calibration_fraction: float = 0.25
    calibration_max_replays: int = 16
    calibration_groups: bool = False
    guard: bool = True
    guard_bound: float = 0.3
    guard_tolerance: float = 0.25
    solver: Method = Method.AUTO
    solver_time_limit_s: float = 0.05
    ema_decay: float = 0.9
    margin_fraction: float = 0.05
    min_batch_size: int = 1
    max_batch_size: int = 65536
    batch_dim: int = 0
    max_events: int = 200
    monitor_interval_s: float = 1.0
    monitor_history: int = 600
    codec_impl: str | None = None
    sync_ranks: bool = True

    def __post_init__(self) -> None:
        allowed_bits = (1, 2, 4, 8)
        if not self.bit_choices or any(b not in allowed_bits for b in self.bit_choices):
            raise ConfigError(f"bit_choices={self.bit_choices!r}: each must be one of {allowed_bits}")
        if len(set(self.bit_choices)) != len(self.bit_choices):
            raise ConfigError(f"bit_choices={self.bit_choices!r} has duplicates")
        object.__setattr__(self, "bit_choices", tuple(sorted(self.bit_choices)))
        lo, hi = min(self.bit_choices), max(self.bit_choices)
        if self.bits is not None and (
            isinstance(self.bits, bool) or not isinstance(self.bits, int | float) or not lo <= self.bits <= hi
        ):
            raise ConfigError(
                f"bits={self.bits!r}: the average bits per value must be a number in [{lo}, {hi}] "
                f"(the range of bit_choices={self.bit_choices}), or None for the adaptive policy"
            )
        _positive_int("min_numel", self.min_numel, zero_ok=True)
        if self.log_prob_bits is not None and (
            isinstance(self.log_prob_bits, bool) or self.log_prob_bits not in (4, 8)
        ):
            raise ConfigError(
                f"log_prob_bits={self.log_prob_bits!r}: must be 4 or 8 (bits of the stored "
                "probabilities), or None to keep log-softmax outputs exact"
            )
        for name in ("attention_bits", "attention_value_bits", "norm_bits", "head_bits", "gate_bits",
                     "bottleneck_bits"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or value not in (2, 4, 8)):
                raise ConfigError(
                    f"{name}={value!r}: must be 2, 4 or 8 (the least bits of those tensors), "
                    "or None for no floor"
                )
        _positive_int("group_size", self.group_size)
        if self.group_size % 8:
            raise ConfigError(f"group_size={self.group_size}: must be a multiple of 8 (e.g. 256)")
        for name, kind in (("codec", CodecMode), ("objective", Objective), ("solver", Method)):
            if name == "objective" and self.objective is None:
                continue
            object.__setattr__(self, name, _member(name, getattr(self, name), kind))
        _positive_int("allocation_interval", self.allocation_interval)
        _positive_float("variance_bound", self.variance_bound)
        if self.variance_metric not in ("update", "gradient"):
            raise ConfigError(
                f"variance_metric={self.variance_metric!r}: must be 'update' (noise as the optimizer's "
                "step carries it) or 'gradient' (the gradient's squared norm)"
            )
        _positive_int("warmup_steps", self.warmup_steps, zero_ok=True)
        fraction = self.calibration_fraction
        if not (isinstance(fraction, int | float) and not isinstance(fraction, bool)
                and math.isfinite(fraction) and fraction >= 0):
            raise ConfigError(
                f"calibration_fraction={self.calibration_fraction!r}: must be a number >= 0 "
                "(share of training time for calibration; 0 turns it off)"
            )
        _positive_int("calibration_max_replays", self.calibration_max_replays)
        if not isinstance(self.guard, bool):
            raise ConfigError(f"guard={self.guard!r}: must be True or False")
        if not isinstance(self.calibration_groups, bool):
            raise ConfigError(f"calibration_groups={self.calibration_groups!r}: must be True or False")
        if not isinstance(self.fused_rnn, bool):
            raise ConfigError(f"fused_rnn={self.fused_rnn!r}: must be True or False")
        if not isinstance(self.attention_recompute, bool):
            raise ConfigError(f"attention_recompute={self.attention_recompute!r}: must be True or False")
        _positive_float("guard_bound", self.guard_bound)
        _positive_float("guard_tolerance", self.guard_tolerance)
        _positive_float("solver_time_limit_s", self.solver_time_limit_s)
        if not 0.0 <= self.ema_decay < 1.0:
            raise ConfigError(f"ema_decay={self.ema_decay!r}: must be in [0, 1)")
        if not 0.0 <= self.margin_fraction < 0.5:
            raise ConfigError(f"margin_fraction={self.margin_fraction!r}: must be in [0, 0.5)")
        _positive_int("min_batch_size", self.min_batch_size)
        _positive_int("max_batch_size", self.max_batch_size)
        if self.min_batch_size > self.max_batch_size:
            raise ConfigError(
                f"min_batch_size={self.min_batch_size} exceeds max_batch_size={self.max_batch_size}"
            )
        _positive_int("batch_dim", self.batch_dim, zero_ok=True)
        _positive_int("max_events", self.max_events)
        if not (math.isfinite(self.monitor_interval_s) and self.monitor_interval_s >= 0):
            raise ConfigError(
                f"monitor_interval_s={self.monitor_interval_s!r}: must be >= 0 (0 disables the monitor)"
            )
        _positive_int("monitor_history", self.monitor_history)
        impls = ("reference", "cpu", "cuda")
        if self.codec_impl is not None:
            value = getattr(self.codec_impl, "value", self.codec_impl)
            if value not in impls:
                raise ConfigError(
                    f"codec_impl={self.codec_impl!r}: expected one of {impls} or None (automatic)"
                )
            object.__setattr__(self, "codec_impl", value)
        if not isinstance(self.sync_ranks, bool):
            raise ConfigError(f"sync_ranks={self.sync_ranks!r}: must be True or False")


def _member(name: str, value: object, kind: type[enum.Enum]) -> enum.Enum:
    """``value`` as a member of the string enum ``kind`` (given as the member or its value)."""
    try:
        return kind(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r}: expected one of {[m.value for m in kind]}") from None


def _positive_int(name: str, value: object, *, zero_ok: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if zero_ok else 1):
        bound = ">= 0" if zero_ok else ">= 1"
        raise ConfigError(f"{name}={value!r}: must be an int {bound}")


def _positive_float(name: str, value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigError(f"{name}={value!r}: must be a finite number > 0")
