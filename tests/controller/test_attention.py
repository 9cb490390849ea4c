"""An explicit attention's probabilities recomputed from its query and key records
(NOTE [ Attention probabilities recomputed from query and key ], memctl/controller/attention.py)."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memctl
from memctl.codecs.base import Packed
from memctl.controller.attention import logits_of, probabilities
from memctl.controller.derived import Derived
from memctl.controller.expressions import scalar_of
from tests.controller.packers import eight_bits_beside_plain

_MASKS = ("none", "masked_fill", "fill_tensor", "full_mask", "additive", "lowest", "alibi", "safe")


class _Attention(nn.Module):
    """One explicit self-attention layer and a head, with the mask written as ``mask`` says."""

    def __init__(self, mask: str, d: int = 32, heads: int = 4, t: int = 24) -> None:
        super().__init__()
        self.mask, self.heads = mask, heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.register_buffer("causal", torch.ones(t, t, dtype=torch.bool).tril())
        self.register_buffer("bias", -0.25 * torch.arange(t).float().view(1, t).expand(t, t).clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in self.qkv(x).chunk(3, dim=-1))
        s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(d // self.heads))
        causal = self.causal[:t, :t]
        if self.mask == "masked_fill":
            s = s.masked_fill(~causal, float("-inf"))
        elif self.mask == "fill_tensor":  # the fill value a 0-dim tensor: MaskedFillBackward1
            s = s.masked_fill(~causal, torch.tensor(float("-inf")))
        elif self.mask == "full_mask":  # a mask of the logits' own size: a bit map is smaller
            s = s.masked_fill((~causal).expand(b, self.heads, t, t).contiguous(), float("-inf"))
        elif self.mask == "additive":
            s = s + torch.zeros(t, t).masked_fill(~causal, float("-inf"))
        elif self.mask == "lowest":
            s = s + torch.zeros(t, t).masked_fill(~causal, torch.finfo(s.dtype).min)
        elif self.mask == "alibi":
            s = s + self.bias[:t, :t]
        elif self.mask == "safe":  # the first query sees nothing: _safe_softmax gives it zeros
            s = s.masked_fill(~(causal & (torch.arange(t) > 0).view(t, 1)), float("-inf"))
        p = torch._safe_softmax(s, -1) if self.mask == "safe" else torch.softmax(s, dim=-1)
        y = (p @ v).transpose(1, 2).reshape(b, t, d)
        return self.proj(y)


def _recording(ctl: memctl.Controller) -> list[Any]:
    """A list that receives the record of every softmax result ``ctl`` packs from now on."""
    packer = ctl._packer
    pack = packer.pack
    found: list[Any] = []

    def recording(t: torch.Tensor) -> Any:
        saved = pack(t)
        if t.grad_fn is not None and "Softmax" in type(t.grad_fn).__name__:
            found.append(saved)
        return saved

    packer.pack = recording  # type: ignore[method-assign]
    ctl._scope._pack = recording
    return found


def _record(saved: Any) -> Any:
    """The record a pack returned (a queued pack's, once packed)."""
    return getattr(saved, "saved", None) or saved


def _grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("mask", _MASKS)
def test_probabilities_recomputed_from_exact_operands_are_the_softmax_bit_for_bit(mask: str) -> None:
    torch.manual_seed(0)
    model = _Attention(mask)
    x = torch.randn(2, 24, 32)
    seen: list[tuple[torch.Tensor, Any]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.grad_fn is not None and "Softmax" in type(t.grad_fn).__name__:
            seen.append((t, logits_of(t.grad_fn, t.dim(), scalar_of)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    (p, logits), = seen
    assert logits is not None
    assert logits.masked is (mask != "none")
    assert logits.added is (mask in ("additive", "lowest", "alibi"))
    a, b = logits.matmul._saved_self, logits.matmul._saved_mat2
    rebuilt = probabilities(logits, a, b, (p == 0) if logits.masked else None, tuple(p.shape))
    assert torch.equal(rebuilt, p) is (mask != "alibi")  # a bias no bit map reproduces


@pytest.mark.parametrize("mask", _MASKS)
def test_probabilities_keep_no_record_and_the_gradient_stays_plain_pytorchs(mask: str) -> None:
    """At 8 bits everywhere the recomputed probabilities give plain PyTorch's gradient to
    within the 8-bit records' error; an ALiBi bias fails the check and keeps the record."""
    torch.manual_seed(0)
    model = _Attention(mask)
    x = torch.randn(2, 24, 32)
    plain, opt, ctl = eight_bits_beside_plain(model, x)
    try:
        records = _recording(ctl)
        for _ in range(2):  # the second forward: a structure checked once is not checked again
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        first, saved = (_record(r) for r in records)
        assert type(first.data) is type(saved.data)
        if mask == "alibi":
            assert isinstance(saved.data, Packed) and saved.data.params["bits"] == 8
        else:
            assert isinstance(saved.data, Derived)
            # the key, then the masked_fill's own mask or a bit map of the zeros
            assert len(saved.data.others) == (1 if mask == "none" else 2)
            if len(saved.data.others) == 2:
                fill = isinstance(saved.data.others[1], torch.Tensor)
                assert fill is (mask in ("masked_fill", "fill_tensor", "safe"))
        a, b = _grads(model).double(), _grads(plain).double()
        assert float(a @ b / (a.norm() * b.norm())) > 0.9999
    finally:
        ctl.detach()


def test_recomputed_probabilities_cost_less_and_train_like_the_record() -> None:
    """The layer's bytes without the probabilities' 8-bit record (an eighth back for the
    bit map), and the same training at the default policy within noise."""
    results = {}
    for recompute in (True, False):
        torch.manual_seed(0)
        model = _Attention("masked_fill")
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        ctl = memctl.Controller(model, opt, bits=2.0, monitor_interval_s=0, min_numel=0,
                                attention_recompute=recompute)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(4, 24, 32, generator=g)
        target = torch.randn(4, 24, 32, generator=g)
        losses = []
        try:
            for _ in range(30):
                loss = F.mse_loss(model(x), target)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(float(loss.detach()))
            stats = ctl.stats()
        finally:
            ctl.detach()
        results[recompute] = (losses, stats["packed_bytes"])
    (on, on_bytes), (off, off_bytes) = results[True], results[False]
    probabilities_bytes = 4 * 4 * 24 * 24  # batch x heads x T x T at 8 bits
    assert off_bytes - on_bytes >= 0.8 * probabilities_bytes
    drop_on, drop_off = on[0] - on[-1], off[0] - off[-1]
    assert drop_on > 0.9 * drop_off
    assert all(math.isfinite(v) for v in on)


def test_gradient_accumulation_and_a_backward_that_reads_the_probabilities_once() -> None:
    """Two micro-batches; each backward decodes the query and key once for the probabilities
    and the logits matmul (NOTE [ One decode for several readers ])."""
    torch.manual_seed(0)
    model = _Attention("masked_fill")
    plain = copy.deepcopy(model)
    xs = [torch.randn(2, 24, 32) for _ in range(2)]
    for x in xs:
        plain(x).square().mean().backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ctl = memctl.Controller(model, opt, bits=8.0, bit_choices=(8,), calibration_fraction=0.0,
                            monitor_interval_s=0, min_numel=0)
    try:
        losses = [model(x).square().mean() for x in xs]
        for loss in reversed(losses):
            loss.backward()
        a, b = _grads(model).double(), _grads(plain).double()
        assert float(a @ b / (a.norm() * b.norm())) > 0.9999
    finally:
        ctl.detach()


def test_recompute_turns_off() -> None:
    torch.manual_seed(0)
    model = _Attention("none")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ctl = memctl.Controller(model, opt, bits=2.0, monitor_interval_s=0, min_numel=0,
                            attention_recompute=False)
    try:
        records = _recording(ctl)
        model(torch.randn(2, 24, 32)).square().mean().backward()
        (saved,) = (_record(r) for r in records)
        assert isinstance(saved.data, Packed)
    finally:
        ctl.detach()
    with pytest.raises(memctl.ConfigError, match="attention_recompute"):
        memctl.Controller(nn.Linear(2, 2), torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1),
                          attention_recompute="yes")  # type: ignore[arg-type]


class _Dropped(_Attention):
    """The causal layer with dropout on its probabilities (nanoGPT's ``attn_dropout``)."""

    def __init__(self) -> None:
        super().__init__("masked_fill")
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in self.qkv(x).chunk(3, dim=-1))
        s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(d // self.heads))
        p = self.drop(torch.softmax(s.masked_fill(~self.causal[:t, :t], float("-inf")), dim=-1))
        return self.proj((p @ v).transpose(1, 2).reshape(b, t, d))


def test_a_dropout_of_recomputed_probabilities_is_recomputed_too() -> None:
    """The dropout's output, ``P·M``, is read from the probabilities' recomputation and the
    dropout's own mask record: no record of its own, and plain PyTorch's gradient with the
    same draws."""
    torch.manual_seed(0)
    model = _Dropped()
    plain = copy.deepcopy(model)
    x = torch.randn(2, 24, 32)
    torch.manual_seed(5)
    plain(x).square().mean().backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ctl = memctl.Controller(model, opt, bits=8.0, bit_choices=(8,), calibration_fraction=0.0,
                            monitor_interval_s=0, min_numel=0)
    packer = ctl._packer
    pack = packer.pack
    operands: list[Any] = []

    def recording(t: torch.Tensor) -> Any:
        saved = pack(t)
        if t.dim() == 3 and t.shape[-1] == t.shape[-2]:  # the second matmul's (B·H, T, T) operand
            operands.append(saved)
        return saved

    packer.pack = recording  # type: ignore[method-assign]
    ctl._scope._pack = recording
    try:
        torch.manual_seed(5)
        model(x).square().mean().backward()
        (saved,) = (_record(r) for r in operands)
        assert isinstance(saved.data, Derived) and isinstance(saved.data.source.data, Derived)
        a, b = _grads(model).double(), _grads(plain).double()
        assert float(a @ b / (a.norm() * b.norm())) > 0.9999
    finally:
        ctl.detach()
