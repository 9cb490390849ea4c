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
of log-softmax is linear in ``exp(y) = p̂``, so its gradient is unbiased. Each group's
largest probability is kept aside, exact (4 bytes and its 2-byte place per group of 256),
and the others are quantised on the range they span: the error of each is at most the
group's *second* largest probability over ``2^b − 1``. A confident token's ``p`` comes
back exact, and the small probabilities next to it carry noise on their own scale, not
on the confident token's: at ``p = 0.99`` with the rest 0.01 spread over the vocabulary,
quantised with the largest in the range (as until 2026-11-24) each of the rest was
rounded to 0 or to 0.99/255 = 0.004 at 8 bits, stochastic noise of the order of the
row's whole gradient ``p − 1`` (0.01); now the step is the rest's own largest over 255.
Log-domain quantisation would instead make the error relative to the largest.

The default is 4 bits. Measured (512 rows of 512 logits, the cross-entropy gradient
``p − onehot`` against the noise the record adds to ``p``, norm over norm, mean of 4
seeds), by how confident the rows are (mean largest probability):

    largest p    before, 8 bits   before, 4 bits   now, 8 bits   now, 4 bits
    0.027            0.0009          0.0148           0.0006        0.0096
    0.091            0.0035          0.0406           0.0007        0.0115
    0.728            0.0407          0.2222           0.0007        0.0119
    0.992            0.2944          1.2849           0.0007        0.0123

so 4 bits now add less noise than 8 bits did once rows are even mildly confident, and
about 1% of the gradient's norm (10⁻⁴ of its square) where they are flat.

The range of the rest: the largest's place is filled with the rest's smallest value
before the group is quantised, so the group's range is the rest's own, from its smallest
to its largest. Until 2026-11-27 it was filled with 0, so the range started at 0, the
smallest probabilities could round to 0, and the clamp below raised them back to the
group's smallest: their mean read was above the true value, and every read biased the
logits' gradient the same way (the library BERT of ``benchmarks/gradient_bias.py``: the
mean of 64 draws of the head's LayerNorm bias gradient 0.45% of its norm from the exact
one, 7.4 times what unbiased draws give).

Decoding clamps every value to its group's smallest true log-probability, kept exactly (4
bytes per group), so every value comes back finite and within its group's range (a
``−inf`` would read as ``p = 0`` in the log-softmax backward, harmless, but not in another
op reading the same saved tensor, an entropy term ``p · log p``). Values that were
``−inf`` (a masked vocabulary) or NaN come back as they were; in a group that holds a
``−inf`` the floor is ``−inf``.

The record is not under the allocation's control (its bits are the configuration's,
its bytes count as fixed), and calibration replays keep it exact, so a layer's
measured added variance does not include its noise.

NOTE [ Rows no loss reads ]
``cross_entropy`` with an ``ignore_index`` (masked-language-model labels, padding, the
last position of a causal LM's shifted labels) gives the ignored rows a zero gradient:
``nll_loss``'s backward writes 0 there, and log-softmax's backward ``g − exp(y)·Σg``
is 0 on a row whose ``g`` is 0, whatever ``y`` is. Those rows of ``y`` are never read.
A BERT-style MLM ignores 85% of its rows, so the record is mostly values no gradient
depends on.

When the loss is computed inside the model's forward (Hugging Face models given
``labels``), a log-softmax output is not encoded when packed but held, raw, until the
model's forward ends. The packer first looks at the model's outputs. If one of them is an
``nll_loss`` of that log-softmax (found within a few nodes: a division by the token
count, a sum), with a 2-d input, a softmax over the last dimension and a 1-d target, then
only the rows whose target is not ``ignore_index`` are encoded, with their indices.
Decoding puts ``−log V`` (a uniform distribution, finite) in the other rows. The rows are
kept whole when anything else saved the same tensor (``Saved.readers`` above two: the
log-softmax and the loss), when two losses read it, or when it was modified in place. A
loss computed outside the model (``F.cross_entropy(model(x), y)``) is encoded at once, all
rows, as before: nothing ends that forward before the backward. The held tensor lives
from the log-softmax to the end of the forward, the few ops of the loss; its bytes count
as exact until it is encoded. On the library BERT of ``benchmarks/fidelity.py`` (15% of
tokens masked) the record falls from 274 KB to 43 KB and the default ratio from 7.0x to
8.5x, at the same loss drop.
"""

from __future__ import annotations

import math

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

    __slots__ = ("floors", "group", "probs", "rows", "top", "top_at")

    def __init__(self, probs: Packed, floors: torch.Tensor, group: int, top: torch.Tensor,
                 top_at: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        self.top = top
        """Each group's largest probability, exact (float32; NOTE [ Log-probabilities ])."""
        self.top_at = top_at
        """Its place in its group (int16, int32 for groups of more than 2^15 values)."""
        self.probs = probs
        """The quantize codec's record of ``exp(y)`` (float32)."""
        self.floors = floors
        """Each group's smallest log-probability (float32, ``−inf`` for a group holding one)."""
        self.group = group
        self.rows = rows
        """The rows held (int32 indices into ``y`` as ``(rows, V)``), or None: all of them
        (NOTE [ Rows no loss reads ])."""

    @property
    def nbytes(self) -> int:
        """Real bytes held: the probabilities' record plus the floors."""
        rows = 0 if self.rows is None else self.rows.numel() * self.rows.element_size()
        top = self.top.nbytes + self.top_at.nbytes
        return self.probs.nbytes + self.floors.numel() * self.floors.element_size() + rows + top


def _grouped(flat: torch.Tensor, group: int, fill: float) -> torch.Tensor:
    pad = (-flat.numel()) % group
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad), value=fill)
    return flat.view(-1, group)


def encode_log_probs(t: torch.Tensor, codec: Codec, bits: int, seed: int, group: int,
                     rows: torch.Tensor | None = None) -> LogProbs:
    """``t`` (a log-softmax output) as :class:`LogProbs` (NOTE [ Log-probabilities ]); only
    ``rows`` of ``t`` as ``(rows, last dimension)`` when given (NOTE [ Rows no loss reads ])."""
    y = t.detach()
    if rows is not None:
        rows = rows.to(device=t.device, dtype=torch.int32)
        y = y.reshape(-1, t.shape[-1]).index_select(0, rows)
    y = y.reshape(-1).float()
    finite_or_neg_inf = torch.where(torch.isnan(y), torch.inf, y)  # NaN never sets a floor
    floors = _grouped(finite_or_neg_inf, group, torch.inf).amin(dim=1)
    p = y.exp()
    n = p.numel()
    grouped = _grouped(p, group, 0.0)  # (p is this function's own: changed in place)
    top, top_at = grouped.max(dim=1)  # kept exact; the rest quantised on the scale of what is left
    # NOTE [ Log-probabilities ], "the range of the rest": the top's place takes the rest's
    # smallest value, so that no value can round below it
    rest = grouped.scatter(1, top_at[:, None], math.inf)
    if rest.numel() > n:
        rest.view(-1)[n:] = math.inf  # the last group's padding
    least = rest.amin(dim=1)
    least = torch.where(torch.isinf(least), torch.zeros_like(least), least)  # a group of one value
    grouped.scatter_(1, top_at[:, None], least[:, None])
    probs = codec.encode(grouped.reshape(-1)[:n], bits=bits, seed=seed)
    place = torch.int16 if group <= 2**15 else torch.int32
    return LogProbs(probs, floors, group, top, top_at.to(place), rows)


def decode_log_probs(record: LogProbs, codec: Codec, shape: tuple[int, ...],
                     dtype: torch.dtype) -> torch.Tensor:
    """The log-probabilities a :class:`LogProbs` holds, every finite value within its group's range."""
    p = codec.decode(record.probs).reshape(-1)
    n = p.numel()
    grouped = _grouped(p, record.group, 1.0)  # (the decode's own tensor: changed in place)
    grouped.scatter_(1, record.top_at.long()[:, None], record.top[:, None])
    y = grouped.log()
    y = torch.maximum(y, record.floors[:, None])  # NaN stays NaN; a −inf floor changes nothing
    if record.rows is None:
        return y.reshape(-1)[:n].reshape(shape).to(dtype)
    width = shape[-1]
    full = torch.full((math.prod(shape) // width, width), -math.log(width), dtype=torch.float32,
                      device=p.device)
    full.index_copy_(0, record.rows.long(), y.reshape(-1)[:n].view(-1, width))
    return full.reshape(shape).to(dtype)
