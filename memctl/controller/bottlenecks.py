"""Linear layers that widen a narrow input: their input's floor.

NOTE [ Bottleneck inputs ]
A linear layer whose input has far fewer features than its output (LoRA's ``B`` on the
rank-``r`` projection ``A x``, an adapter's up-projection) computes its weight gradient from
that narrow input: ``dB = g (A x)^T``. Quantised at 2 bits, the input's noise went straight
into the only gradient the layer's weight gets, and nothing averaged it away: on peft's LoRA
over a small Llama (r = 8 on width 256) at ``bits=2`` the ``B`` matrices' gradient carried
0.41 of its own squared norm in added noise, where full fine-tuning's weight gradients
carried 0.016, and 30 steps reached 85.6% of plain's loss drop (91.2% with those inputs held,
full fine-tuning 96.7%). Such an input is small: ``in_features / out_features`` of the
layer's output, at most an eighth. So a ``nn.Linear`` (or subclass) with ``in_features * 8
<= out_features`` takes at least ``bottleneck_bits`` (8) bits, a floor of the same kind as
the calibration's evidence floors (dropped when a budget cannot be met with it); at 8 bits
its input costs at most half of its output's bytes at 2 bits, and LoRA's a sixteenth or
less. The input must also be narrow for the model: ``in_features * 8`` at most the widest
input of its linear layers. A language model's head widens the model's full width into
the vocabulary (GPT-2: 768 -> 50,257) and is no bottleneck: its input keeps ``head_bits``
(NOTE [ The head's input ] in heads.py). Narrow model inputs (coordinates into a first
layer) are held as model inputs anyway.
"""

from __future__ import annotations

import torch

from memctl.controller.hooks import hookable_modules

__all__ = ["WIDENING", "bottleneck_layers"]

WIDENING = 8
"""Least ``out_features / in_features`` of a bottleneck's widening layer."""


def bottleneck_layers(model: torch.nn.Module, bits: int | None) -> dict[str, float]:
    """Layer name -> floor of ``model``'s linear layers that widen an input :data:`WIDENING`
    times narrower than their output and than the widest linear input (NOTE [ Bottleneck
    inputs ]); empty when ``bits`` is None."""
    if bits is None:
        return {}
    linears = [(name, m) for name, m in hookable_modules(model) if name and isinstance(m, torch.nn.Linear)]
    widest = max((m.in_features for _, m in linears), default=0)
    return {name: float(bits) for name, m in linears
            if m.in_features * WIDENING <= min(m.out_features, widest)}
