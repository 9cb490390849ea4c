"""The calibrated variance model: what compressing each layer at each bit width really adds.

NOTE [ Calibration ]
The closed form of NOTE [ Sensitivity ] (ActNN's C_l / (2^b − 1)²) only sees a layer's
own weight gradient, through a product of averages. On real networks it is wrong by
orders of magnitude, and not by one factor: on a ResNet-18 the BatchNorm inputs of the
last stage add ~5000x more whole-gradient noise per unit of C_l than those of the
first, because BatchNorm's backward reads its saved input to form the input gradient,
so an error there reaches every layer below; and at 1 bit the noise grows much faster
than (2^b − 1)⁻² predicts (1 bit vs 2 bits: 10–70x, not 9x). An allocation that trusts
the closed form gives 1 bit to exactly the layers that make training diverge.

So the controller measures. On calibration steps (the steps whose boundary re-solves
the allocation) it replays the step (NOTE [ Replay ]) with every layer exact, and then
with one layer's saved tensors compressed at b bits and the rest exact: the squared
distance between the two whole-model gradients is the variance (with any bias) that
compressing that layer at b bits adds, measured. A measurement is kept as a factor
over the closed form at the time, so between measurements the estimate still follows
the layer's gradient and range statistics:

    V_l(b) = S · v(l, b) · clip(√(p_l(b) / p_meas(l, b)), 1/2, 2)        p = P / S, P = closed form

with v and p_meas means over the last few probes of the measured value and of the closed
form, each divided by its probe's ‖g‖² (NOTE [ Gradient scale ]), outliers left out (one measurement
is one random draw: on BatchNorm inputs, whose error lands in few directions, single draws
spread by up to 7x, and some draws are absurd: NOTE [ Robust measurements ]). The drift
is damped and clipped because the closed form of a layer
without parameters borrows the median output gradient, which can move the wrong way.

NOTE [ Gradient scale ]
What compressing a layer adds moves with the gradient's own size, and in the first tens of
steps that moves fast and both ways (MobileNetV3 of ``benchmarks/fidelity.py``: the exact
gradient's squared norm 8 -> 33 -> 11 over 20 steps; ViT-Tiny 74 -> 18 -> 4), while a layer's
added variance over ‖g‖² stays within ~2-3x (MobileNetV3, six layers at 2 bits, steps 1-20).
Means of raw values over the last five probes then mix draws taken at scales 10x apart. So a
probe's values are stored over that probe's exact ‖g‖² (``record_reference`` comes first and
sets the unit), the minibatch gradient's variance tr Var(g) likewise, and an estimate is the
stored ratio times ``S`` (``grad_sq``), an EMA of ‖g‖² over the probes (the last probe alone swings with one
batch). The bound and the estimates then share one scale, and what the allocation compares
is what the probes measured relative to the gradient, whenever they measured it. Between
probes ``S`` moves as the training gradient does (NOTE [ Gradient scale between probes ]).
Measured (``fidelity.py --configs varcheck --steps 40``, CPU): ViT-Tiny's predictions made
before each measurement of a pair measured before, median 274x -> 67x of the value; held-out
widths within 2x 17/72 -> 40/72; MobileNetV3's held-out widths 0/48 -> 22/48. A state saved
before this (no ``relative`` mark) held absolute values; it is converted with its own ‖g‖²
EMA as the unit.

NOTE [ Gradient scale between probes ]
Probes are rare (one per ``allocation_interval`` steps at most, fewer once every layer is
measured), and a gradient can fall by orders of magnitude between two of them: ResNet-18 of
``benchmarks/fidelity.py`` goes from ‖g‖² 207 at its first probe to 0.005 twenty steps on.
With ``S`` held at the probes', every absolute figure (``stats()["layers"]``'s predicted
variance, the bound's reference) was that far off: the ``varcheck`` audit at the end of that
run found predictions 10²-10⁴ times the fresh draws, 4 of 48 (layer, width) pairs within 2x.

So ``S`` moves between probes as the training gradient does. While calibration is on (not
under FSDP2, where no probe runs) the controller reads the squared norm ‖ĝ‖² of the gradient
the optimizer stepped with (the parameters' ``.grad``: one ``_foreach_norm`` and one read-back
per device and dtype, 4.6 ms for ResNet-18's 11.3M parameters at one thread on the 2-core CPU
box, ~1% of its step) at the boundaries of the steps that gather the layers' statistics (NOTE
[ Sparse gradient statistics ]: the first two and the two before each re-solve) and at least
one in eight between, before the boundary's probe, and keeps an EMA (0.5 a step, the steps
not read held at the next value read) of ‖ĝ‖² / (1 + a), a the allocation in use's predicted
added variance over the unit (E‖ĝ‖² = ‖g‖² + what compression adds). Read at every boundary
until 2026-11-28, it was a third to a half of a small model's step boundary: the 3-layer MLP
of ``benchmarks/training.py`` with the probes on, 1.24-1.70 ms a boundary -> 0.72-1.05 ms
(``benchmarks/overhead.py``, three runs each), with the same ``fidelity.py`` rows.
:meth:`Calibration.unit` is ``S`` times that EMA over
its value at the last probe, and a probe weighs its ‖g‖² against the moved scale, not against
the probe before. The ratio, not ‖ĝ‖² itself: the replay's ‖g‖² is taken after the optimizer's
step with the step's own output gradients, the boundary's before it, and the two differ by a
factor that holds from one probe to the next far better than the gradient does (GPT-2:
1.6-2.6x after its first step, 15x at the first).

The closed forms move with it. An unmeasured layer's estimate is its closed form times a
factor fitted at a probe (NOTE [ Unmeasured layers ]), and a measured layer's drifts with its
closed form; the closed form's ‖∇Y‖² is read on two steps in ten and smoothed (NOTE [ Sparse
gradient statistics ] in stats.py), so after a fall it trails the gradient by orders of
magnitude. Against a bound that follows the gradient, ResNet-18's unmeasured layers then
looked 10³-10⁵ times louder than the audit measured, and the default policy put them at 8
bits (10.97x -> 7.48x). So :meth:`Calibration._level` scales a closed form by
(unit now / unit at the last probe) · (median ‖∇Y‖² at the last probe / median now): its
overall level moves with the unit, a layer's share among the layers with its own statistics.

A measured layer's drift (NOTE [ Calibration ]) follows the same share: each measurement
keeps, per probe, its closed form over that probe's median ‖∇Y‖² (``Measurement.shares``),
and the drift is √ of today's closed form over today's median against that, clipped at 2x.
Compared through the units instead, a measurement from an earlier probe than the last saw
the lag between its probe and the last as drift: on ResNet-18's ``varcheck`` run every
measured pair's prediction sat at exactly twice its stored value (the clip), while the
stored values matched the audit's fresh draws within 1.3x; with shares, 47 of 48 pairs
within 2x (25 before). A measurement stored without shares (a state saved before them, a
probe without the median) drifts as before.

Above 2 bits, a layer's widths share one scale pooled from 2 bits up under the (2^b − 1)⁻² law
(:func:`law`, which counts 8 bits' smaller groups; the law holds per layer from 2 bits up
within ~1.3x on the nets we measured; NOTE [ Pooling the widths from 2 bits up ]). An
unmeasured 1 bit comes from 2 bits by the law
times the largest 1-bit/2-bit excess seen on any layer (8 until one is seen); an
unmeasured width >= 2 of a layer measured only at 1 bit, from 1 bit by the law. An
unmeasured layer takes the factor fitted for its bit width (NOTE [ Unmeasured layers ]),
and before the first fit the largest factor of any measured layer. A bit width below 2 is
allowed for a layer only once it has been measured there (:meth:`Calibration.floor`): 1 bit
is the width whose damage the closed form hides. With the probes off
(``calibration_fraction=0``) nothing is ever measured, so no layer gets 1 bit unless 1 bit
is all ``bit_choices`` offers. (Before, the closed form alone decided there: MobileNetV3 of
``benchmarks/fidelity.py`` at ``bits=2`` took 1 bit on 76 of its 104 layers and 8 bits on
8, and one draw of its gradient at fixed weights was 6-8 times the gradient's norm off,
against 0.48 with every layer at 2 bits; ``benchmarks/gradient_bias.py --model``.)

The same probe measures the minibatch gradient's own variance (the reference of the
variance bound): the batch is replayed as two halves A and B, each against its part of
the output gradient, and E‖g_A − g_B‖² = tr Var(g) for a gradient that sums N
independent per-sample terms (BatchNorm couples the samples, so this is approximate).
It also replays the allocation in use, whose measured added variance the convergence
guard (NOTE [ Convergence guard ]) compares with the bound.

NOTE [ The median's layers ]
The median ‖∇Y‖² that the closed forms' level is read against (NOTE [ Gradient scale between
probes ]) is a median over the layers that have a ‖∇Y‖², and that set changes when blocks
open. In RegNetY-200MF (``benchmarks/fidelity.py``) every block's last batch norm starts at a
zero scale (NOTE [ Gates near zero ]): at the first probe no gradient reaches the layers inside
the blocks, and the median (4.6e-4) was over the shortcut path; ten steps on, the blocks open
and their layers, with gradients that have only begun to grow, join it: 1.5e-7. The level then
multiplied every closed form by 2,194. For the layers whose closed form borrows the median
that was right, but a layer with its own ‖∇Y‖² had not moved (``s3.b2.conv3.bn`` 0.27 -> 0.45),
and its 2-bit estimate went to 40 where a probe at that step measured the layers of its kind at
~0.03: with no probe due at step 10 (NOTE [ Probe cost ]) the re-solve put 17 layers at 8 bits
and 54 at 4 (7.4x).

So a probe keeps the layers its median was taken over (``median_layers``), and every median
until the next probe is taken over those of them that still have one: the level compares the
same layers at both ends. A probe takes its median over all that have one now, and keeps those.
RegNetY's step-10 re-solve: 88 layers at 2 bits and 24 at 4, none at 8, the estimates at 2 bits
of the blocks' last batch norms 0.02-0.06.

NOTE [ One bit is never quieter than two ]
A layer's 1-bit estimate is at least ``ONE_BIT_LEAST`` (4) times its 2-bit one. Stochastic
rounding to 1 bit adds at least the variance rounding to 2 bits adds at every value of a
group (with ``u`` the value above the group's minimum and ``R`` the range, ``u(R − u) ≥
(u − kΔ)((k + 1)Δ − u)`` for ``Δ = R/3``), and summed over groups of 256 it is 9x for
values spread evenly over the range, 11.7x for normal ones, 8.2-8.4x for half-normal ones
(with or without ReLU's zeros), 6.9x for a GELU's outputs and 4.5x for log-normal ones. A
1-bit measurement is one or two draws, though, and 1 bit keeps its own (NOTE [ Pooling the
widths from 2 bits up ]): on the LSTM of ``benchmarks/convergence.py --tasks text-lstm``
(fused layers, whose backward runs the layer again from the rounded input) the second probe
measured the recurrent layer at 1 bit below 2 bits (1.05e-3 against 1.25e-3 of the unit,
where fixed-width runs at the same step measure 8x between them), and ``bits=2`` took 1 bit
there, as the quieter and smaller choice: +6.4% of plain's validation loss over 300 steps,
until the guard raised it at step 150, against +2.4% with 1 bit out of ``bit_choices``.
With the floor that allocation keeps 2 bits on both layers (the sixteen models of
``fidelity.py`` allocate as before). It did not settle the LSTM at ``bits=2`` alone: at
seeds 0 and 2 the guard then raised the head to 4 bits at step 150, and holding the average
took the recurrent layer to 1 bit after all (+10.0% and +9.0%; seed 1, no guard event,
+2.6%), until NOTE [ A raise is not paid for with 1 bit ] in guard.py kept it at 2 (+2.4%).
What 1 bit there costs under AdamW the gradient's metric does not see: fixed-width runs put
its added ‖Δg‖² at 0.3% of ‖g‖², where the head's at 2 bits is 7%; in the update metric
(NOTE [ Update metric ]) ``bits=2`` ends +2.15% and the default +0.54% (seed 0).

NOTE [ Widths a record is stored at ]
A layer given ``b`` bits does not always store its records at ``b``: the input of a
value-dependent op (GELU, SiLU, hardswish, ELU, ...) whose output no record holds is encoded
again at twice its bits, at most 8 (NOTE [ Outputs recomputed from the input ] in derived.py).
A probe replays one layer at a time with every other layer exact, so the next layer's record
of the op's output is a copy and the op's input is raised in every such replay: measured "at
2 bits" it was stored at 4, "at 4" and "at 8" at 8. Pooled under the law of the nominal widths
(NOTE [ Pooling the widths from 2 bits up ]) those draws mixed 4- and 8-bit records as if they
were 2- and 4-bit ones: at the end of ViT-Tiny's ``varcheck`` run (``benchmarks/fidelity.py``)
every MLP's GELU input was predicted 53-115x over the fresh draws at 4 bits and 4-8x under
at 8, where the draws at 4 and 8 bits were the same to a few percent.

So each replay says which layers' records it stored wider (``Replayer.raised``, from the
``raised_values`` its packer counted), a layer measured below 8 bits is marked by the last
such replay (``note_width``), and for a marked layer every closed form, measurement and law
between widths uses the width stored (``stored_bits``: ``min(8, 2b)``): 4 and 8 bits then
predict the same, 1 bit is a 2-bit record (no 1-bit excess), and an 8-bit measurement speaks
for every width stored at 8. What training stores for the same layer can differ (there the
op's output record is compressed too and may be derived from the input: NOTE [ Outputs
recomputed from the input ]); the model predicts what its replays measure, as before.

NOTE [ Stale widths give way ]
The schedule measures the stalest pairs, but once every layer is measured the probes take a
fifth of the share (NOTE [ Probe cost ]) and measure a few pairs each. Over 300 steps of
``benchmarks/convergence.py``'s text model at ``bits=2`` (``--audit 4``: fresh replays at the
last step) the three blocks' GELU inputs were predicted 7-26x under at 2 bits; the first had
been measured at 2 bits at step 0 and at 1 bit at step 140, and the estimate at 2 bits, which
keeps its own running mean (NOTE [ Pooling the widths from 2 bits up ]), stood on the step-0
draw, where the 1-bit draw, moved by the law between the widths stored (NOTE [ Widths a
record is stored at ]: 2 and 4 bits), was within 2.2x. So when another width of the same
layer whose records follow the law (stored at 2 bits or more: not a 1-bit record, whose
excess over the law is its own) was measured more than ``_STALE_STEPS`` (50) steps after a
measurement of the layer, that older one is left out of every estimate (its own width's,
the pool's): the newer ones speak for its width, moved by the law and their own drift. A
run of a few tens of steps, whose probes come every few steps, never meets the condition.

The same age ends a width's own window: a draw taken more than ``_STALE_STEPS`` steps after
the window's last starts it again (the first GELU input's 2-bit draws at steps 0 and 150 were
20x apart against ‖g‖², and their mean stood for neither). And a probe refreshes such pairs
(2 bits and 1 bit measured more than ``_STALE_STEPS`` steps ago, oldest first) before it fills
in widths above 2 bits that were never measured, which the law already covers: at the fifth
share a probe of the text model measures four pairs, and two probes of 4-bit pairs, stored
at 8 bits where the GELU inputs' records are raised, had left those inputs' 2-bit estimate on
step 0's draw (a measurement stored at 8 bits does not speak for lower widths: NOTE [
Eight-bit groups ]).

NOTE [ Unmeasured layers ]
Per-layer factors over the closed form span more than three orders of magnitude within
one network (on MobileNetV3, 8e-5 for a BatchNorm input and 0.28 for the hardswish input
next to it), so extrapolating from the one or two layers the first probes measure fails
either way: the largest factor seen at step 0 (one layer, 8e-5) predicted 0.64 for an
allocation that added 186, and the largest at step 10 (0.28) made every layer look too
noisy even at 8 bits, so the allocation fell back to 8 bits everywhere (3.5x). Nor does
one width speak for another: on a ViT a factor fitted at 8 bits and moved to 2 bits by
the (2^b − 1)⁻² law predicted 0.32 for an allocation that added 1340.
So while some layers are unmeasured, each probe also replays every layer at once at each
bit width b >= 2 (one replay per width; 1 bit is never given to an unmeasured layer),
and whatever of that total ``A_b`` the measured layers' estimates do not explain is
charged to the unmeasured layers in proportion to their closed forms:

    f_b = max(A_b − Σ_measured V_l(b), A_b / 4) / Σ_unmeasured P_l(b)

(the floor because ``A_b`` is one random draw), a running mean over probes. The total
predicted for a uniform width then matches what was measured, and the allocation and the
guard work from calibrated totals while the per-layer measurements fill in.

Cost: each replay is one forward and backward. Calibration spends at most
``calibration_fraction`` of the training time (measured by the clock, unused time
carries over), at least one layer measurement per probe, so a large model is
calibrated over a number of intervals, 2 bits before 1, the largest layers and the loudest
guesses first (NOTE [ Which layers first ]).
See NOTE [ Probe cost ] for how the share is kept.

NOTE [ Which layers first ]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
The first probe measures a few layers (NOTE [ Probe cost ]: as many as its fixed replays,
seven on a CNN), and its cost is paid back over more steps than a short run has, so for a
while every other layer is priced by the uniform replays' fit: its closed form times the
width's factor (NOTE [ Unmeasured layers ]). Where the closed form is wrong by orders of
magnitude the fit charges the total to the wrong layers, and the allocation raises those:
RegNetY-200MF's default run put 18 layers at 8 bits, the inputs of the blocks' last and
downsampling batch norms, whose estimates made up most of the predicted 2-bit total
(``s1.b1.downsample.bn`` alone 184 of 320); the audit measured ``s1.b1.conv3.bn`` at a tenth
of the stem's. Measured largest first, those small layers wait. So the unmeasured layers of a
width are taken alternately from two orders: by size (the bytes the allocation can win back)
and by their current estimate (the guesses that move the allocation most). At the default
policy, 20 steps (``benchmarks/fidelity.py``, CPU), size only -> loudest only -> alternating:
ResNet-18 10.7x -> 9.6x -> 10.2x, RegNetY 7.2x -> 7.6x -> 7.3x, MobileNetV3 9.6x -> 10.3x ->
10.3x (its loss drop 96.2% -> 98.4% -> 98.1% of plain's), ResNet-18's drop 99.8-99.9%
throughout.

NOTE [ Probe cost ]
~~~~~~~~~~~~~~~~~~~
A probe has fixed replays that no allowance can drop: the exact gradient, the
allocation in use and the two half batches (four forward-and-backward passes, seven
while layers are unmeasured), plus at least one layer. At one probe per
``allocation_interval`` (10) steps that alone is 40-70% of the training time,
whatever ``calibration_fraction`` says. So what a probe spends beyond its share is a
debt: the carry goes negative, and a probe is due only once the time trained since the
last one has paid it back (``affords``); the skipped steps' time keeps accruing. The
share is ``calibration_fraction`` while any layer is unmeasured, and a fifth of it
afterwards: the measurements then only follow drift, and a long run should not pay a
quarter of its time for that. While layers are unmeasured a probe also measures at least
as many of them as it has fixed replays (those above and one per uniform width of NOTE [
Unmeasured layers ]), or all of them where fewer, so that at most half of it is overhead:
measured one layer a probe, the 4-layer GRU of benchmarks/training.py paid 8 replays per
layer and took four probes, and ~95 steps at the quarter share, to finish; now its first
probe measures every layer at 2 bits (8 replays in all; the uniform replays are not needed
once none is unmeasured). The floor counts unmeasured layers, not (layer, width) pairs: a
probe measures a layer at 1 bit beyond that only where its share allows, as before, since
1 bit is the width whose damage the closed form hides and a layer may take it once measured
there. The debt keeps the share: a larger probe is followed by a longer wait. Under a process
group every rank must probe at the same steps, so ranks keep one probe per allocation step
(NOTE [ Calibration across ranks ]).

Once every layer is measured the same floor holds, over the pairs the schedule refreshes (the
stalest, the doubtful, widths never measured), and a probe's debt is repaid at the share it ran
under. Before, the probe that measured the last layers ran at the full share, then repaid its
debt at the fifth, five times as slowly, and every later probe was four fixed replays around one
pair: over 300 steps of ``benchmarks/convergence.py``'s text model at ``bits=2`` (69 ms a step,
replays 57 ms) three probes ran, at steps 0, 170 and 240, four of six layers stood on step 0's
draw at the end, and ``--audit 4`` found 7 of 24 (layer, width) pairs within 2x of fresh draws,
the three GELU inputs 7-25x under at every width. Now three or four probes (steps 0, 30-50,
150-170, and 260-270 when the clock allows) measure 6, 4, 4 and 4 pairs; with NOTE [ Stale
widths give way ]'s order the audit finds 14-18 of 24 pairs within 2x at ``bits=2`` and 18-24
at the default policy over seeds 0-2 (7-11 and 8-16 before). Under a process group (every
allocation step probes) a probe still measures what its share allows, at least one.

NOTE [ Doubtful measurements ]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Blocks that start closed open during training: a residual block whose last batch norm has a
zero-initialised scale (RegNet, and ResNets built with ``zero_init_residual``), a layer scale
of 1e-6 (ConvNeXt, CaiT). Measured at the first probe, a layer inside such a block adds next to
nothing (RegNetY-200MF of ``benchmarks/fidelity.py``: ``s1.b1.conv2.bn.act`` at 2 bits 1.2e-9 of
the gradient's ‖g‖² at step 0, 4.7e-7 in fresh draws at step 20), and with stalest-first
refreshing in a model of 112 layers it was not measured again within 20 steps: predicted
100-700x under what it adds, on the side that gives such a layer the fewest bits. Neither the
drift (its closed form borrows the median output gradient) nor the outlier rules saw it. So:

- *The schedule measures doubtful values again first*: a pair whose closed-form share
  (NOTE [ Gradient scale between probes ]) moved more than the drift's clip can follow (4x
  either way) since it was measured, and a single measurement more than 100x below the median
  factor over the closed form of its width's measured layers (with five or more of them). The
  most doubtful first; up to half of a probe's layer replays go to them ahead of the
  unmeasured layers (which the uniform replays' fit covers, NOTE [ Unmeasured layers ]), the
  rest after those, before the stalest. A second measurement, or a share back within 4x,
  clears the doubt.
- *A measurement whose closed form moved far against the gradient's scale is doubtful too*:
  its closed form over :meth:`Calibration.unit`, now against the same ratio at the
  measurement, beyond 16x either way. ConvNeXt's blocks open together (every layer scale
  grows from 1e-6), so no layer's share among the layers moves, but each closed form grows
  against ‖g‖² (``stages.0.blocks.1.conv_dw``: 2.6e5x in 20 steps) as what the layer adds
  does. The bar is higher than the share's 4x because closed forms trail a falling gradient
  (NOTE [ Gradient scale between probes ]): after ResNet-18's fall every layer moves against
  the unit, and the order by score then re-measures the most moved first. ``varcheck``
  audit (20 steps, CPU), within 2x before -> after this rule: ConvNeXt-atto 6/48 -> 12/48
  (worst 685x -> 28x), RegNetY 5/48 -> 16/48, ResNet-18 47/48 -> 46/48, GPT-2 14/16 -> 13/16,
  ViT-Tiny 4/48 -> 5/48, MobileNetV3 0/48 -> 0/48.
- *Two probes in a row far above a window start it again*: when a layer's last two values
  both exceed ``SUSPECT`` (8) times the robust mean of its draws before them, those earlier
  draws describe another model and are dropped. One probe alone stays an outlier, outvoted
  as NOTE [ Robust measurements ] says.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from memctl.controller.config import KEEP_BITS, ControllerConfig
from memctl.controller.derived import DERIVED_MAX_BITS
from memctl.controller.outliers import SUSPECT, robust_value
from memctl.controller.stats import LayerState, median_grad_sq

__all__ = ["EIGHT_BIT_RANGES", "Calibration", "Measurement", "closed_form", "law"]

# 1-bit over 2-bit noise factor assumed until one is measured (ResNet-18 shows up to ~7.5).
_DEFAULT_ONE_BIT_EXCESS = 8.0
ONE_BIT_LEAST = 4.0
"""The least a layer's 1-bit estimate is, in 2-bit estimates (NOTE [ One bit is never quieter
than two ])."""
_DRIFT_CLIP = 2.0
_STALE_STEPS = 50
"""A measurement this many steps older than one of the same layer at another width gives way
to it (NOTE [ Stale widths give way ])."""
_EMA = 0.5
_WINDOW = 5
_DOUBT_LOW = 100.0
"""A single measurement this far below its width's median factor over the closed form is doubtful."""
_DOUBT_PEERS = 5
_LEVEL_MOVED = 16.0
"""A layer whose closed form over the unit moved this far since it was measured is doubtful."""
"""Measured layers a width needs before its median factor is trusted."""


@dataclass(frozen=True)
class Measurement:
    """One measured added variance of one layer at one bit width."""

    value: float
    """Outlier-free mean of the measured added variance over the last ``_WINDOW`` probes
    (NOTE [ Robust measurements ])."""
    closed_form: float
    """Mean of the closed form at the same probes."""
    step: int
    """Step of the last measurement."""
    count: int = 1
    draws: tuple[float, ...] = ()
    """The last ``_WINDOW`` probes' values (oldest first)."""
    closed_draws: tuple[float, ...] = ()
    shares: tuple[float, ...] = ()
    """Per probe, the closed form over the median ‖∇Y‖² then: the layer's share among the
    layers, what its drift follows (NOTE [ Gradient scale between probes ]); empty for
    measurements taken before it was kept."""

    @property
    def share(self) -> float | None:
        return sum(self.shares) / len(self.shares) if self.shares else None


EIGHT_BIT_RANGES = 0.69
"""The share of a tensor's ``Σ R_g² · G`` left in groups of a quarter the size, the 8-bit
records' groups (NOTE [ Eight-bit groups ] in the quantize codec): median 0.69 over the
saved tensors of eleven models of ``benchmarks/fidelity.py`` (0.62-0.71 a model over its
tensors; tensors from the 10th to the 90th percentile 0.55-0.75; Mamba's median 0.38, some
of T5's and LeViT's 1.0), measured once. A layer's range statistics are at the configured groups at
every width (NOTE [ Range statistics ] in packing.py), so the law scales 8 bits by it."""


def law(bits: int) -> float:
    """``(2^b − 1)²`` over the share of the squared ranges left in a width's groups: the divisor
    of the closed form at ``bits`` bits (NOTE [ Eight-bit groups ]: 8 bits by :data:`EIGHT_BIT_RANGES`;
    a configured group that is not a multiple of 32 keeps its size at 8 bits, where this
    predicts 0.69x of the closed form, inside the factor the probes correct)."""
    step = float(2**bits - 1) ** 2
    return step / EIGHT_BIT_RANGES if bits == 8 else step


def closed_form(state: LayerState, fallback_g2: float, bits: float) -> float:
    """ActNN's prediction C_l / (2^b − 1)² (0 for "keep"), its 8-bit groups' ranges counted (:func:`law`)."""
    if bits >= KEEP_BITS:
        return 0.0
    return state.sensitivity(fallback_g2) / law(int(bits))


class Calibration:
    """Per-layer measurements, the model built on them, and the probe's schedule."""

    def __init__(self, config: ControllerConfig) -> None:
        self._config = config
        self.measured: dict[str, dict[int, Measurement]] = {}
        self.raised: set[str] = set()
        """Layers whose records a replay stored at twice their bits (NOTE [ Widths a record is
        stored at ])."""
        self.grad_sq: float | None = None
        """EMA of the exact gradient's squared norm at the probes: what one stored unit of
        added variance is worth now (NOTE [ Gradient scale ]); None before a probe."""
        self._probe_unit: float | None = None
        """The last probe's exact squared gradient norm, the unit its values are stored in."""
        self._train_sq: float | None = None
        """EMA of the training gradient's squared norm over the step boundaries (NOTE [ Gradient
        scale between probes ])."""
        self._train_step: int | None = None
        """The step of the last ‖ĝ‖² in :attr:`_train_sq`."""
        self._anchor_sq: float | None = None
        """The training gradient's squared norm at the weights of the last probe (None: the
        next boundary's sets it)."""
        self._probe_scale: tuple[float, float] | None = None
        """The unit and the median ‖∇Y‖² at the last probe (NOTE [ Gradient scale between
        probes ]): the closed forms' level, and the measurements' shares."""
        self.median_layers: frozenset[str] | None = None
        """The layers that median was taken over, and every median until the next probe's
        (NOTE [ The median's layers ]); None: all that observed a ‖∇Y‖²."""
        self.added_share = 0.0
        """The allocation in use's predicted added variance over :meth:`unit`, when it was solved."""
        self._noise: float | None = None
        """EMA of tr Var(g), the minibatch gradient's own variance, over its probe's ‖g‖²."""
        self.added: float | None = None
        """Added variance of the allocation in use, measured at the last probe."""
        self.added_predicted: float | None = None
        self.width_factors: dict[int, float] = {}
        """Per bit width, the factor over the closed form for layers not measured yet
        (NOTE [ Unmeasured layers ])."""
        self.replay_s: float | None = None
        self.carry_s = 0.0
        self.complete: bool | None = None
        """Whether every layer was measured, as the last probe saw it (None before one)."""
        self.probes = 0
        self.footprints: dict[str, tuple[int, ...]] = {}
        """Per layer, the parameters (indices) its compression error lands in; empty when it
        spreads wider (NOTE [ Several layers per replay ])."""
        self.unsafe: dict[str, int] = {}
        """Per layer, the widest bit width that produced an absurd draw (NOTE [ Robust measurements ])."""
        self._disabled = False
        self.metric: str | None = None
        """The metric every squared norm above is taken in (NOTE [ Update metric ] in
        update_metric.py): ``"update"`` or ``"gradient"``; None before the first probe."""

    def use_metric(self, metric: str) -> str | None:
        """Measure in ``metric`` from now on. What was measured in another one is dropped (it
        does not compare); returns that other metric when something was, else None."""
        before = self.metric
        if before is None or metric == before:
            self.metric = metric
            return None
        had = bool(self.measured) or self.grad_sq is not None
        kept = (self.probes, self.replay_s, self.carry_s, self.footprints, self.unsafe, self._disabled)
        self.__init__(self._config)  # type: ignore[misc]
        self.probes, self.replay_s, self.carry_s, self.footprints, self.unsafe, self._disabled = kept
        self.metric = metric
        return before if had else None

    @property
    def enabled(self) -> bool:
        return self._config.calibration_fraction > 0 and not self._disabled

    def disable(self) -> None:
        """Stop probing (after a probe failed); what was measured stays in use."""
        self._disabled = True

    # -- measurements ---------------------------------------------------------------
    def unit(self) -> float:
        """What one stored unit of added variance is now (NOTE [ Gradient scale ]): the probes'
        ‖g‖², moved as the training gradient's has since (NOTE [ Gradient scale between probes ])."""
        if not self.grad_sq:
            return 1.0
        if self._anchor_sq and self._train_sq:
            return self.grad_sq * (self._train_sq / self._anchor_sq)
        return self.grad_sq

    def observe_training(self, grad_sq: float | None, step: int | None = None) -> None:
        """The training gradient's squared norm at the boundary of ``step``, before that boundary's
        probe (NOTE [ Gradient scale between probes ]); the EMA decays per step since the last."""
        if grad_sq is None or not math.isfinite(grad_sq) or grad_sq <= 0:
            return
        gap = 1 if step is None or self._train_step is None else max(step - self._train_step, 1)
        self._train_step = step
        # E‖ĝ‖² = ‖g‖² + what compression adds
        self._train_sq = _ema(self._train_sq, grad_sq / (1.0 + self.added_share), gap)
        if self._anchor_sq is None:
            self._anchor_sq = self._train_sq

    @property
    def grad_noise(self) -> float | None:
        """tr Var(g) at the probes: an EMA of its ratio to ‖g‖², at today's :attr:`grad_sq`."""
        return None if self._noise is None else self._noise * self.unit()

    def record(self, layer: str, bits: int, value: float, predicted: float, step: int) -> None:
        """Fold one probe's value into the layer's robust mean over the last ``_WINDOW`` probes
        (NOTE [ Robust measurements ]); a non-finite value is not a measurement."""
        if not (math.isfinite(value) and value >= 0):
            return
        unit = self._probe_unit or 1.0  # NOTE [ Gradient scale ]
        share = predicted / self._probe_scale[1] if self._probe_scale else None
        value, predicted = value / unit, predicted / unit
        mine = self.measured.setdefault(layer, {})
        old = mine.get(bits)
        if old is not None and step - old.step > _STALE_STEPS:  # NOTE [ Stale widths give way ]
            old = None
        draws = ((old.draws or (old.value,)) if old is not None else ()) + (value,)
        closed = ((old.closed_draws or (old.closed_form,)) if old is not None else ()) + (predicted,)
        draws, closed = draws[-_WINDOW:], closed[-_WINDOW:]
        # a probe without the median keeps the drift as it was (NOTE [ Gradient scale between probes ])
        shares = ((old.shares if old is not None else ()) + (share,))[-_WINDOW:] if share is not None else ()
        if len(draws) > 2 and min(draws[-2:]) > SUSPECT * robust_value(draws[:-2]):
            # NOTE [ Doubtful measurements ]: two probes in a row far above the draws before them
            draws, closed, shares = draws[-2:], closed[-2:], shares[-2:]
        mine[bits] = Measurement(robust_value(draws), sum(closed) / len(closed), step,
                                 (old.count if old is not None else 0) + 1, draws, closed, shares)

    def mark_unsafe(self, layer: str, bits: int) -> None:
        """Remember that ``layer`` at ``bits`` produced an absurd draw (NOTE [ Robust measurements ])."""
        self.unsafe[layer] = max(self.unsafe.get(layer, 0), bits)

    def record_reference(self, grad_sq: float | None, noise: float | None,
                         median_grad_sq: float | None = None, among: frozenset[str] | None = None) -> None:
        """A probe's exact squared gradient norm and tr Var(g); call it before the probe's layer
        values are recorded: its ‖g‖² is their unit (NOTE [ Gradient scale ]). ``median_grad_sq``:
        the layers' median smoothed ‖∇Y‖² at the probe, what the closed forms stand on, taken over
        the layers ``among`` (NOTE [ The median's layers ])."""
        if grad_sq is not None and math.isfinite(grad_sq) and grad_sq > 0:
            self._probe_unit = grad_sq
            # the previous scale, moved to this step by the training gradient, then this probe
            self.grad_sq = _ema(self.unit() if self.grad_sq else None, grad_sq)
            self._anchor_sq = self._train_sq
            self._probe_scale = None
            self.median_layers = None
            if median_grad_sq is not None and math.isfinite(median_grad_sq) and median_grad_sq > 0:
                self._probe_scale = (self.grad_sq, median_grad_sq)
                self.median_layers = among
        if noise is not None and math.isfinite(noise) and noise > 0:
            self._noise = _ema(self._noise, noise / (self._probe_unit or 1.0))

    def median_grad_sq(self, layers: list[LayerState]) -> float:
        """The median ‖∇Y‖² the closed forms stand on between probes: over the layers the last
        probe's was taken over (NOTE [ The median's layers ])."""
        return median_grad_sq(layers, self.median_layers)

    def reference(self) -> float | None:
        """The variance the bound is relative to: tr Var(g) if measured, else ‖g‖²."""
        if self._noise:
            return self._noise * self.unit()
        return self.grad_sq

    # -- the model ----------------------------------------------------------------------
    def estimate(self, state: LayerState, fallback_g2: float, bits: float) -> float:
        """V_l(b) of NOTE [ Calibration ] (the closed form when nothing was measured yet); at 1 bit
        at least :data:`ONE_BIT_LEAST` times the 2-bit estimate (NOTE [ One bit is never quieter
        than two ])."""
        value = self._estimate(state, fallback_g2, bits)
        if int(bits) == 1:
            value = max(value, ONE_BIT_LEAST * self._estimate(state, fallback_g2, 2))
        return value

    def _estimate(self, state: LayerState, fallback_g2: float, bits: float) -> float:
        if bits >= KEEP_BITS:
            return 0.0
        b = int(bits)
        stored = self.stored_bits(state.name, b)  # NOTE [ Widths a record is stored at ]
        raw = closed_form(state, fallback_g2, stored)
        mine = self._fresh(state.name, _speaking_for(stored, self.measured.get(state.name, {}),
                                                     lambda k: self.stored_bits(state.name, k)))
        unit = self.unit()  # NOTE [ Gradient scale ]: measurements are kept in units of it
        p = raw * self._level(unit, fallback_g2)
        # NOTE [ Gradient scale between probes ]: a measured layer drifts with its share
        share_now = raw / fallback_g2 if fallback_g2 > 0 else 0.0
        pooled = (_pooled(mine, lambda k: self.stored_bits(state.name, k))
                  if b > 2 or (b == 2 and 2 not in mine) else None)
        if pooled is not None:  # NOTE [ Pooling the widths from 2 bits up ]
            scale, closed_scale, share_scale = pooled
            step = law(stored)
            drift = (_drift(share_now, share_scale / step) if share_scale is not None
                     else _drift(p / unit, closed_scale / step))
            return scale / step * drift * unit
        if b in mine:
            m = mine[b]
            share = m.share
            drift = _drift(share_now, share) if share is not None else _drift(p / unit, m.closed_form)
            return m.value * drift * unit
        if mine:
            near = min(mine, key=lambda k: (abs(k - b), -k))
            m = mine[near]
            near_raw = closed_form(state, fallback_g2, self.stored_bits(state.name, near))
            value = m.value * _law(stored, self.stored_bits(state.name, near), raw, near_raw) * unit
            if stored == 1 and near >= 2:
                value *= self.one_bit_excess()
            return value
        fitted = _speaking_for(b, self.width_factors)
        if fitted:
            near = min(fitted, key=lambda k: (abs(k - b), -k))
            # a width not fitted (1 bit) takes the nearest one's factor, times the 1-bit excess
            excess = self.one_bit_excess() if stored == 1 and near >= 2 else 1.0
            return fitted[near] * p * excess
        largest = self._largest_factor(b)
        return p if largest is None else largest * p

    def _fresh(self, layer: str, mine: dict[int, Measurement]) -> dict[int, Measurement]:
        """``mine`` without the measurements at widths whose records follow the law (stored at 2
        bits or more) taken more than :data:`_STALE_STEPS` steps before the newest such one
        (NOTE [ Stale widths give way ])."""
        follows = [m.step for k, m in mine.items() if self.stored_bits(layer, k) >= 2]
        if len(follows) < 2:
            return mine
        oldest = max(follows) - _STALE_STEPS
        return {k: m for k, m in mine.items() if m.step >= oldest or self.stored_bits(layer, k) < 2}

    def note_width(self, layer: str, bits: int, raised: bool) -> None:
        """What a replay of ``layer`` at ``bits`` stored: its records raised to twice the bits
        or not (NOTE [ Widths a record is stored at ]). At the widest width no record can be
        raised, so it says nothing."""
        if int(bits) >= DERIVED_MAX_BITS:
            return
        if raised:
            self.raised.add(layer)
        else:
            self.raised.discard(layer)

    def stored_bits(self, layer: str, bits: int) -> int:
        """The width ``layer``'s records are stored at when it is given ``bits`` (NOTE [ Widths
        a record is stored at ])."""
        b = int(bits)
        if layer in self.raised and b < DERIVED_MAX_BITS:
            return min(DERIVED_MAX_BITS, 2 * b)
        return b

    def closed_form(self, state: LayerState, fallback_g2: float, bits: float) -> float:
        """:func:`closed_form` at the width the layer's records are stored at for ``bits``."""
        if bits >= KEEP_BITS:
            return 0.0
        return closed_form(state, fallback_g2, self.stored_bits(state.name, int(bits)))

    def _level(self, unit: float, fallback_g2: float) -> float:
        """What moves a closed form's overall scale as the unit (``unit``, now) has moved since
        the last probe rather than as the median ‖∇Y‖² has (NOTE [ Gradient scale between
        probes ]): a layer's own share among the layers still moves it."""
        if self._probe_scale is None or not fallback_g2 > 0:
            return 1.0
        then, g2 = self._probe_scale
        return (unit / then) * (g2 / fallback_g2)

    def unmeasured(self, layers: Iterable[LayerState]) -> bool:
        """Whether any of ``layers`` has no measurement yet (also kept as :attr:`complete`)."""
        layers = list(layers)
        missing = self.count_unmeasured(layers) > 0
        if layers:
            self.complete = not missing
        return missing

    def count_unmeasured(self, layers: Iterable[LayerState]) -> int:
        """How many of ``layers`` have no measurement yet."""
        return sum(1 for s in layers if not self.measured.get(s.name))

    def fit_width(self, bits: int, added: float, layers: Iterable[LayerState], fallback_g2: float) -> None:
        """Fit the unmeasured layers' factor at ``bits`` to ``added``, measured with every layer at
        ``bits`` (NOTE [ Unmeasured layers ])."""
        if not (math.isfinite(added) and added >= 0):
            return
        explained = 0.0
        closed = 0.0
        for state in layers:
            if self.measured.get(state.name):
                explained += self.estimate(state, fallback_g2, bits)
            else:
                closed += self.closed_form(state, fallback_g2, bits)
        if not (closed > 0 and math.isfinite(closed)):
            return
        factor = max(added - explained, added / 4.0) / closed
        self.width_factors[bits] = _ema(self.width_factors.get(bits), factor)

    def floor(self, state: LayerState) -> float | None:
        """The lowest bit width the allocation may give ``state`` (None: no floor): 2 bits
        until 1 bit is measured (with the probes off, never), and above any width that
        produced an absurd draw."""
        choices = self._config.bit_choices
        floors: list[float] = []
        safe = [b for b in choices if b >= 2]
        if safe and 1 in choices and 1 not in self.measured.get(state.name, {}):
            floors.append(float(min(safe)))
        bad = self.unsafe.get(state.name)
        if bad is not None:
            floors.append(float(next((b for b in sorted(choices) if b > bad), KEEP_BITS)))
        return max(floors) if floors else None

    def one_bit_excess(self) -> float:
        """Largest (1-bit factor) / (2-bit factor) over layers measured at both, but those whose
        1 bit is a 2-bit record (NOTE [ Widths a record is stored at ])."""
        ratios = [
            (mine[1].value / mine[1].closed_form) / (mine[2].value / mine[2].closed_form)
            for name, mine in self.measured.items()
            if 1 in mine and 2 in mine and mine[1].closed_form > 0 and mine[2].closed_form > 0
            and mine[2].value > 0 and name not in self.raised
        ]
        return max(max(ratios), 1.0) if ratios else _DEFAULT_ONE_BIT_EXCESS

    def _largest_factor(self, bits: int) -> float | None:
        exact = [m.value / m.closed_form for mine in self.measured.values()
                 for k, m in mine.items() if k == bits and m.closed_form > 0]
        if exact:
            return max(exact)
        other = [m.value / m.closed_form for mine in self.measured.values()
                 for m in mine.values() if m.closed_form > 0]
        if not other:
            return None
        return max(other) * (self.one_bit_excess() if bits == 1 else 1.0)

    # -- the schedule -------------------------------------------------------------------
    def order(self) -> list[int]:
        """Bit widths in the order they are measured: the lowest width >= 2 first, then up from 1."""
        choices = sorted(self._config.bit_choices)
        safe = [b for b in choices if b >= 2]
        first = safe[0] if safe else choices[0]
        return [first, *[b for b in choices if b != first]]

    def schedule(self, layers: Iterable[LayerState], limit: int, fallback_g2: float | None = None,
                 doubts_first: int = 0, step: int | None = None) -> list[tuple[str, int]]:
        """Up to ``limit`` (layer, bits) pairs to measure next: up to ``doubts_first`` doubtful
        measurements, the unmeasured pairs (at ``step``, the widths above 2 bits after the pairs
        gone stale, NOTE [ Stale widths give way ]), the other doubtful ones, then the stalest
        (NOTE [ Doubtful measurements ])."""
        ranked = sorted(layers, key=lambda s: (-sum(s.numels), s.name))
        order = self.order()
        doubtful = self.doubtful(ranked, fallback_g2)
        taken = set(doubtful)
        names = {s.name for s in ranked}
        by_age = sorted((m.step, name, b) for name, mine in self.measured.items() if name in names
                        for b, m in mine.items() if b in order[:2] and (name, b) not in taken)
        stale = [(name, b) for _, name, b in by_age]
        due = [] if step is None else [(name, b) for then, name, b in by_age if step - then > _STALE_STEPS]
        pairs: list[tuple[str, int]] = doubtful[:doubts_first]
        for b in order:
            if b > 2 and due:
                pairs.extend(due)
                due = []
            missing = [s for s in ranked if b not in self.measured.get(s.name, {})]
            if fallback_g2 is not None and fallback_g2 > 0:  # NOTE [ Which layers first ]
                loud = sorted(missing, key=lambda s: -_finite(self.estimate(s, fallback_g2, b)))
                missing = list({s.name: s for pair in zip(missing, loud, strict=True)
                                for s in pair}.values())
            pairs.extend((s.name, b) for s in missing)
        pairs.extend(due)
        pairs.extend(doubtful[doubts_first:])
        if len(pairs) < limit:
            listed = set(pairs)
            pairs.extend(pair for pair in stale if pair not in listed)
        return pairs[:max(limit, 0)]

    def doubtful(self, layers: Iterable[LayerState], fallback_g2: float | None) -> list[tuple[str, int]]:
        """Measured pairs to measure again before the stalest, most doubtful first (NOTE [ Doubtful
        measurements ]): the layer's closed-form share moved past what the drift may follow since
        it was measured, its closed form moved far against the unit, or a single measurement
        sits far below its width's other layers."""
        factors: dict[int, list[float]] = {}
        for mine in self.measured.values():
            for b, m in mine.items():
                if m.closed_form > 0 and m.value > 0:
                    factors.setdefault(b, []).append(math.log(m.value / m.closed_form))
        medians = {b: sorted(f)[len(f) // 2] for b, f in factors.items() if len(f) >= _DOUBT_PEERS}
        g2 = fallback_g2 if fallback_g2 is not None and fallback_g2 > 0 else 0.0
        unit = self.unit()
        scored: list[tuple[float, str, int]] = []
        for s in layers:
            for b, m in self.measured.get(s.name, {}).items():
                score = 0.0
                raw = self.closed_form(s, g2, b) if g2 > 0 else 0.0
                if raw > 0:
                    then = m.share  # the share among the layers, and the level against the unit
                    if then is not None:
                        moved = abs(math.log(raw / g2 / then)) if then > 0 else math.inf
                        score = max(score, moved - math.log(_DRIFT_CLIP ** 2))
                    if m.closed_form > 0:
                        score = max(score, abs(math.log(raw / unit / m.closed_form)) - math.log(_LEVEL_MOVED))
                if m.count == 1 and b in medians and m.closed_form > 0:  # far below its width's layers
                    factor = math.log(m.value / m.closed_form) if m.value > 0 else -math.inf
                    score = max(score, medians[b] - factor - math.log(_DOUBT_LOW))
                if score > 0:
                    scored.append((-score, s.name, b))
        return [(name, b) for _, name, b in sorted(scored)]

    def share(self) -> float:
        """The share of training time probes may take now (NOTE [ Probe cost ])."""
        fraction = self._config.calibration_fraction
        return fraction if not self.complete else fraction / 5.0

    def affords(self, train_s: float) -> bool:
        """Whether a probe is due by its time budget: the first always, then once the debt
        of the last is paid (NOTE [ Probe cost ])."""
        return self.probes == 0 or self.carry_s + self.share() * max(train_s, 0.0) >= 0.0

    def allowance(self, train_s: float, fixed_replays: int, least: int = 1) -> int:
        """How many layer measurements this probe may run: what its share leaves after
        ``fixed_replays``, and at least ``least`` (NOTE [ Probe cost ])."""
        budget = self.carry_s + self.share() * max(train_s, 0.0)
        per = self.replay_s if self.replay_s else None
        n = least if per is None or per <= 0 else max(int(budget // per) - fixed_replays, least)
        return max(1, min(n, self._config.calibration_max_replays))

    def spend(self, train_s: float, spent_s: float, share: float | None = None) -> None:
        """Carry the unused share of the time budget to the next probe (at most 20 steps' worth),
        or what was overspent as a debt (NOTE [ Probe cost ]). ``share``: the share the probe
        ran under (default: today's); where the probe changed it, the carry is rescaled so that
        it is paid back, or used, in the same training time as at that share."""
        then = self.share() if share is None else share
        budget = self.carry_s + then * max(train_s, 0.0)
        cap = then * max(train_s, 0.0) * 20
        carry = min(budget - spent_s, cap)
        now = self.share()
        self.carry_s = carry * (now / then) if then > 0 and now != then else carry

    def time_replay(self, seconds: float) -> None:
        self.replay_s = _ema(self.replay_s, seconds)

    # -- reporting ------------------------------------------------------------------------
    def report(self, state: LayerState, fallback_g2: float) -> dict[str, dict[str, float]]:
        """``variance_predicted`` / ``variance_closed_form`` / ``variance_measured`` keyed by bits."""
        choices = self._config.bit_choices
        return {
            "variance_predicted": {str(b): self.estimate(state, fallback_g2, b) for b in choices},
            "variance_closed_form": {str(b): closed_form(state, fallback_g2, b) for b in choices},
            "variance_measured": {str(b): m.value * self.unit()
                                  for b, m in sorted(self.measured.get(state.name, {}).items())},
        }

    def state_dict(self) -> dict[str, object]:
        return {
            "measured": {n: {str(b): [m.value, m.closed_form, m.step, m.count, list(m.draws),
                                      list(m.closed_draws), list(m.shares)] for b, m in mine.items()}
                         for n, mine in self.measured.items()},
            "unsafe": dict(self.unsafe),
            "raised": sorted(self.raised),
            "grad_sq": self.grad_sq,
            "grad_noise": self._noise,
            "train_sq": self._train_sq,
            "probe_scale": list(self._probe_scale) if self._probe_scale else None,
            "median_layers": sorted(self.median_layers) if self.median_layers is not None else None,
            "anchor_sq": self._anchor_sq,
            "relative": True,  # NOTE [ Gradient scale ]: values over their probe's ‖g‖²
            "metric": self.metric,  # NOTE [ Update metric ]
            "width_factors": {str(b): f for b, f in self.width_factors.items()},
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        measured = state.get("measured") or {}
        metric = state.get("metric")  # a state saved before NOTE [ Update metric ]: the gradient's
        self.metric = metric if metric in ("update", "gradient") else "gradient" if measured else None
        self.measured = {}
        if isinstance(measured, dict):
            for name, mine in measured.items():
                self.measured[str(name)] = {
                    int(b): Measurement(float(v[0]), float(v[1]), int(v[2]), int(v[3]),
                                        tuple(float(x) for x in (v[4] if len(v) > 4 else ())),
                                        tuple(float(x) for x in (v[5] if len(v) > 5 else ())),
                                        tuple(float(x) for x in (v[6] if len(v) > 6 else ())))
                    for b, v in dict(mine).items()
                }
        unsafe = state.get("unsafe") or {}
        self.unsafe = {str(k): int(v) for k, v in unsafe.items()} if isinstance(unsafe, dict) else {}
        raised = state.get("raised") or []
        self.raised = {str(n) for n in raised} if isinstance(raised, list | tuple) else set()
        g2, noise = state.get("grad_sq"), state.get("grad_noise")
        self.grad_sq = float(g2) if isinstance(g2, int | float) and g2 > 0 else None
        self._noise = float(noise) if isinstance(noise, int | float) else None
        if not state.get("relative") and self.grad_sq:
            # saved before NOTE [ Gradient scale ]: absolute values; the probes' ‖g‖² is their unit
            self._to_units(self.grad_sq)
        self._probe_unit = self.grad_sq
        train, anchor = state.get("train_sq"), state.get("anchor_sq")
        self._train_sq = float(train) if isinstance(train, int | float) and train > 0 else None
        self._anchor_sq = float(anchor) if isinstance(anchor, int | float) and anchor > 0 else None
        scale = state.get("probe_scale")
        self._probe_scale = None
        if isinstance(scale, list | tuple) and len(scale) == 2 and all(
                isinstance(v, int | float) and v > 0 for v in scale):
            self._probe_scale = (float(scale[0]), float(scale[1]))
        among = state.get("median_layers")
        self.median_layers = (frozenset(str(n) for n in among)
                              if self._probe_scale is not None and isinstance(among, list | tuple) else None)
        widths = state.get("width_factors") or {}
        self.width_factors = {}
        if isinstance(widths, dict):
            self.width_factors = {int(b): float(f) for b, f in widths.items()}

    def _to_units(self, unit: float) -> None:
        """Express absolute measurements in units of ``unit`` (a state saved without a scale)."""
        self.measured = {
            name: {b: Measurement(m.value / unit, m.closed_form / unit, m.step, m.count,
                                  tuple(d / unit for d in m.draws), tuple(d / unit for d in m.closed_draws),
                                  m.shares)
                   for b, m in mine.items()}
            for name, mine in self.measured.items()
        }
        self._noise = None if self._noise is None else self._noise / unit


def _pooled(mine: dict[int, Measurement],
            stored: Callable[[int], int] = int) -> tuple[float, float, float | None] | None:
    """The layer's measured and closed-form scales ``V · (2^b − 1)²``, pooled over widths >= 2.

    NOTE [ Pooling the widths from 2 bits up ]
    From 2 bits up, a layer's measured added variance follows the (2^b − 1)⁻² law closely
    (ResNet-18 and the test CNN: within ~1.3x per layer from 2 to 8 bits), but one
    measurement is one random draw, and on a BatchNorm input a draw is heavy-tailed: its
    error reaches the gradient mostly through one scalar per channel (``Σ g·δ`` in the
    input gradient's ``x̂``-term and in the weight's gradient), so a draw's squared norm
    spreads like a chi-square with about C degrees of freedom (C = 8 channels: single
    draws 0.26x to 2.8x of a 4-draw mean, measured). The schedule measures 2 bits at every
    probe and the other widths rarely (once, in the test), so a width's own running mean
    can rest on one draw. The estimate for a width above 2 is therefore the scale
    ``V · (2^b − 1)²`` averaged over every measured width >= 2, each weighted by its
    number of draws (capped at the window): a prediction at 8 bits then rests on all the
    layer's draws, not on its one 8-bit draw. 2 bits keeps its own running mean (measured
    at every probe, it needs no help, and the choice between 1 and 2 bits, which rests on
    the two own measurements, stays as it was); so does 1 bit (it does not follow the law:
    NOTE [ Calibration ]).
    """
    total = scale = closed = shared = 0.0
    every_share = True
    for b, m in mine.items():
        if b < 2 or m.closed_form <= 0:
            continue
        w = float(min(m.count, _WINDOW))
        step = law(stored(b))
        total += w
        scale += w * m.value * step
        closed += w * m.closed_form * step
        share = m.share
        every_share = every_share and share is not None
        shared += w * (share or 0.0) * step
    if total == 0:
        return None
    return scale / total, closed / total, (shared / total if every_share else None)


_T = TypeVar("_T")


def _speaking_for(bits: int, by_width: dict[int, _T],
                  stored: Callable[[int], int] = int) -> dict[int, _T]:
    """The entries of ``by_width`` that may inform a prediction stored at ``bits``: one stored at 8
    bits only at 8 bits (``stored``: the width an entry's records were stored at, NOTE [ Widths a
    record is stored at ]; stale entries are left out by the caller, NOTE [ Stale widths give way ]).
    NOTE [ Eight-bit groups ] in the quantize codec: 8 bits use groups of a quarter
    the size, whose ranges shrink by :data:`EIGHT_BIT_RANGES` on most tensors but by far more
    where the quarters fall on structure (MobileOne's batch-norm inputs, 8x8 channel planes of
    different scales: one step at 8 bits, whole-gradient cosine 0.81 in groups of 256, 0.98 in
    groups of 64). There a measurement at 8 bits, moved to 2 bits by the law, would predict a
    fraction of what 2 bits add. (MobileOne's 20-step loss drop did fall, 97.4% -> 88.4% of
    plain's at seed 0, with six batch-norm layers at 2 bits; but those layers had been
    measured at 2 bits, this rule left that allocation as it was, and other seeds moved the
    other way.) Moved the other way, from the configured groups to 8 bits, the law only
    overstates what 8 bits add."""
    if bits == 8 or all(stored(k) != 8 for k in by_width):
        return by_width
    return {k: v for k, v in by_width.items() if stored(k) != 8}


def _law(b: int, k: int, p_b: float, p_k: float) -> float:
    """V(b) / V(k) by the closed form's (2^b − 1)⁻² law (:func:`law`)."""
    if p_b > 0 and p_k > 0:
        return p_b / p_k
    return law(k) / law(b)


def _finite(value: float) -> float:
    return value if math.isfinite(value) else (math.inf if value > 0 else 0.0)


def _drift(now: float, then: float) -> float:
    """How far the closed form moved since the measurements, damped (square root) and clipped."""
    if now <= 0 or then <= 0:
        return 1.0
    return min(max(math.sqrt(now / then), 1.0 / _DRIFT_CLIP), _DRIFT_CLIP)


def _ema(old: float | None, new: float, steps: int = 1) -> float:
    """The EMA's next value, ``steps`` steps after ``old`` (the steps between held at ``new``)."""
    if old is None or not math.isfinite(old):
        return new
    keep = _EMA ** steps
    return keep * old + (1.0 - keep) * new
