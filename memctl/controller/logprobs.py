"""Log-softmax outputs saved as their probabilities, quantised without bias in the gradient.

NOTE [ Log-probabilities ]
``log_softmax`` saves its output ``y = log p`` and its backward computes
``g − exp(y) · Σ g``; ``nll_loss`` (and so ``cross_entropy``) saves the same tensor and
reads only its shape. Quantising ``y`` itself is what NOTE [ What is compressed ] forbids:
the backward exponentiates it, so an error ``δ`` in ``y`` is a relative error ``e^δ − 1``
in ``p``, biased, and large where it matters (a confident token at ``p = 0.99`` in a
group whose log-probabilities span 20 nats moves by up to 8% at 8 bits, where the
gradient at that token, ``p − 1``, is only 0.01). But keeping it exact is expensive: it
has one value per token and vocabulary entry, often the largest tensor a language model
saves (in the library LMs of ``benchmarks/fidelity.py`` half of all packed bytes at
``bits=2``, and it caps the activation ratio of a real vocabulary at ~5x).

So the tensor is stored as ``p = exp(y)``, quantised by the quantize codec (unbiased
stochastic rounding) at ``log_prob_bits`` bits, and decoded as ``log p̂``. The backward
of log-softmax is linear in ``exp(y) = p̂``, so its gradient is unbiased, and the
error of each probability is at most its group's largest probability over ``2^b − 1``: a
group's largest value is stored exactly (its code is the top level), so a confident
token's ``p`` comes back exact and the small probabilities next to it carry the
noise, in absolute terms, where log-domain quantisation makes it relative to the
largest. A probability rounded down to 0 would decode to ``−inf``, which the
log-softmax backward reads as ``p = 0`` (harmless) but another op reading the same
saved tensor (an entropy term ``p · log p``) would not: decoding clamps every value to
its group's smallest true log-probability, kept exactly (4 bytes per group), so every
value comes back finite and within its group's range. Values that were ``−inf``
(a masked vocabulary) or NaN come back as they were; in a group that holds a ``−inf``
the floor is ``−inf``, so a probability rounded to 0 there reads ``−inf`` as well.

The record is not under the allocation's control (its bits are the configuration's,
its bytes count as fixed), and calibration replays keep it exact, so a layer's
measured added variance does not include its noise.
"""

from __future__ import annotations

import torch

from memctl.codecs.base import Codec, Packed

__all__ = ["LogProbs", "decode_log_probs", "encode_log_probs", "is_log_softmax"]

# grad_fn names of ops whose saved output is a log-softmax (NOTE [ Log-probabilities ]).
_LOG_SOFTMAX = frozenset({"LogSoftmaxBackward0", "LogSoftmaxBackward1"})


def is_log_softmax(t: torch.Tensor) -> bool:
    """Whether ``t`` is the output of a log-softmax (recognised by its autograd node)."""
    return t.grad_fn is not None and type(t.grad_fn).__name__ in _LOG_SOFTMAX


class LogProbs:
    """A log-softmax output held as quantised probabilities and per-group floors."""

    __slots__ = ("floors", "group", "probs")

    def __init__(self, probs: Packed, floors: torch.Tensor, group: int) -> None:
        self.probs = probs
        """The quantize codec's record of ``exp(y)`` (float32)."""
        self.floors = floors
        """Each group's smallest log-probability (float32, ``−inf`` for a group holding one)."""
        self.group = group

    @property
    def nbytes(self) -> int:
        """Real bytes held: the probabilities' record plus the floors."""
        return self.probs.nbytes + self.floors.numel() * self.floors.element_size()


def _grouped(flat: torch.Tensor, group: int, fill: float) -> torch.Tensor:
    pad = (-flat.numel()) % group
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad), value=fill)
    return flat.view(-1, group)


def encode_log_probs(t: torch.Tensor, codec: Codec, bits: int, seed: int, group: int) -> LogProbs:
    """``t`` (a log-softmax output) as :class:`LogProbs` (NOTE [ Log-probabilities ])."""
    y = t.detach().reshape(-1).float()
    finite_or_neg_inf = torch.where(torch.isnan(y), torch.inf, y)  # NaN never sets a floor
    floors = _grouped(finite_or_neg_inf, group, torch.inf).amin(dim=1)
    probs = codec.encode(y.exp(), bits=bits, seed=seed)
    return LogProbs(probs, floors, group)


def decode_log_probs(record: LogProbs, codec: Codec, shape: tuple[int, ...],
                     dtype: torch.dtype) -> torch.Tensor:
    """The log-probabilities a :class:`LogProbs` holds, every finite value within its group's range."""
    p = codec.decode(record.probs).reshape(-1)
    n = p.numel()
    y = _grouped(p.log(), record.group, 0.0)
    y = torch.maximum(y, record.floors[:, None])  # NaN stays NaN; a −inf floor changes nothing
    return y.reshape(-1)[:n].reshape(shape).to(dtype)
