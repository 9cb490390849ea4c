"""Layout copies of a record (NOTE [ Layout copies of a record ], memctl/controller/layout.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memctl
import memctl.controller.packing as packing
from memctl.codecs.base import Packed
from memctl.controller.derived import Derived
from memctl.controller.layout import layout_of, replay
from tests.controller.packers import eight_bits_beside_plain, record_of, records_of


class _Attention(nn.Module):
    """A fused attention whose output the projection reads in another layout, as Hugging
    Face's models and timm's ViT write it (``how``: the layout ops between them)."""

    def __init__(self, how: str, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.how, self.heads = how, heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in self.qkv(x).chunk(3, dim=-1))
        extra = None
        if self.how == "alias":  # the value saved before by another op in another shape (LeViT)
            q, k, value = (z.contiguous() for z in self.qkv(x).chunk(3, dim=-1))
            extra = F.gelu(value)  # saves the value as (b, t, d)
            q, k, v = (z.view(b, 1, t, d) for z in (q, k, value))  # one head: the same storage
        if self.how in ("eager", "alias"):  # OPT, T5, BART: the probabilities' product, which no op saves
            s = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.heads)
            causal = torch.ones(t, t, dtype=torch.bool).tril()
            out = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1) @ v
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, heads, t, d / heads)
        if self.how in ("contiguous", "eager", "alias"):  # Llama, Mistral, GPT-NeoX; OPT, T5, BART
            y = out.transpose(1, 2).contiguous().reshape(b, t, d)
        elif self.how == "reshape":  # timm's ViT
            y = out.transpose(1, 2).reshape(b, t, d)
        elif self.how == "permute":
            y = out.permute(0, 2, 1, 3).reshape(b, t, d)
        else:  # "slice": not every value of the record (its own record)
            y = out.transpose(1, 2).reshape(b, t, d)[:, 1:].contiguous()
        return self.proj(y) if extra is None else self.proj(y) + extra


def _grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()]).double()


@pytest.mark.parametrize("how", ["contiguous", "reshape", "permute", "slice", "eager", "alias"])
def test_the_projection_reads_the_attention_output_record(how: str) -> None:
    torch.manual_seed(0)
    model = _Attention(how)
    x = torch.randn(4, 64, 32)
    plain, opt, ctl = eight_bits_beside_plain(model, x)
    try:
        rows = 4 * (63 if how == "slice" else 64)
        inputs = records_of(ctl, lambda t: tuple(t.shape) == (rows, 32) and t.grad_fn is not None)
        for _ in range(2):  # the second step: the structure was checked once
            inputs.clear()
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        saved = record_of(inputs[-1])  # the projection's input (a 2-D view of a 3-D tensor)
        if how == "slice":
            assert isinstance(saved.data, Packed)
        elif how in ("eager", "alias"):  # the product of the probabilities' and the value's records
            assert isinstance(saved.data, Derived) and len(saved.data.others) == 1
            # an operand saved as an alias is read from its record (a derived record's inputs are
            # records: before, an alias there failed the next forward's region walk)
            assert all(isinstance(r, packing.Saved) for r in (saved.data.source, *saved.data.others))
        else:
            assert isinstance(saved.data, Derived)
            root = saved.data.source.data
            assert isinstance(root, Packed) and root.params["bits"] == 8
        a, b = _grads(model), _grads(plain)
        assert float(a @ b / (a.norm() * b.norm())) > 0.9999
    finally:
        ctl.detach()


def test_at_two_bits_the_copy_costs_no_bytes() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 64, 32)
    sizes = {}
    saved_layout = packing.LAYOUT
    for on in (True, False):
        model = _Attention("contiguous")
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        ctl = memctl.Controller(model, opt, bits=2.0, calibration_fraction=0.0, monitor_interval_s=0,
                                min_numel=0)
        if not on:  # the layout derivation switched off
            packing.LAYOUT = frozenset()
        try:
            for _ in range(2):
                opt.zero_grad()
                model(x).square().mean().backward()
                opt.step()
            sizes[on] = next(r for r in ctl.stats()["layers"] if r["name"] == "proj")["packed_bytes"]
        finally:
            ctl.detach()
            packing.LAYOUT = saved_layout
    assert sizes[True] == 0 < sizes[False]


def test_layout_of_reads_the_steps_and_replay_rebuilds_the_copy() -> None:
    x = torch.randn(2, 3, 4, 5, requires_grad=True)
    base = x * 1.0
    y = base.transpose(1, 2).contiguous().view(2, 4, 15).permute(2, 0, 1).reshape(15, 8)
    found = layout_of(y.grad_fn)
    assert found is not None
    below, nr, steps = found
    assert below is base.grad_fn and nr == 0
    assert torch.equal(replay(steps, y.is_contiguous())(base.detach()), y.detach())
    # a slice is not a layout op: the chain stops at it (a record of the slice would serve)
    sliced = base[:, 1:]
    found = layout_of(sliced.transpose(0, 1).grad_fn)
    assert found is not None and found[0] is sliced.grad_fn
