"""Small records encoded and decoded in batches (NOTE [ Batched small records ])."""

from __future__ import annotations

import copy
import gc
import weakref
from typing import Any

import pytest
import torch
from torch import nn

import memctl
from memctl.codecs.quantize.codec import QuantizeCodec, packed_nbytes
from memctl.controller import batches
from memctl.controller.batches import BATCH_VALUES, BatchRecord
from memctl.controller.config import ControllerConfig
from memctl.controller.hooks import ModuleTracker
from memctl.controller.packing import Packer, Saved
from tests.controller.packers import strict_packer


def _packer(**kw: Any) -> Packer:
    packer = strict_packer(ControllerConfig(min_numel=0, **kw))
    packer.begin_step(0)
    return packer


def _calls(packer: Packer, monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    codec: Any = packer._codec("quantize")
    calls = [0]
    inner = getattr(codec, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return inner(*args, **kwargs)

    monkeypatch.setattr(codec, name, counted)
    return calls


def _gru_grads(batched: bool, bits: int, monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.GRU(16, 64, num_layers=2, batch_first=True)
    x = torch.randn(8, 12, 16)
    if not batched:
        monkeypatch.setattr(batches, "BATCH_BELOW", 0)
    # PyTorch's op: its hundreds of small tensors, not NOTE [ Fused recurrent layers ]
    ctl = memctl.Controller(model, bits=bits, min_numel=0, calibration_fraction=0.0, monitor_interval_s=0,
                            fused_rnn=False)
    model(x)[0].square().mean().backward()
    ctl.detach()
    monkeypatch.undo()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _cos(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    x, y = torch.cat([t.reshape(-1) for t in a]), torch.cat([t.reshape(-1) for t in b])
    return float(x @ y / (x.norm() * y.norm()))


def test_a_recurrent_nets_records_are_encoded_in_a_few_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hundreds of small records, a few encodes and decodes; the gradient as accurate as one by one."""
    torch.manual_seed(0)
    exact = [p.grad for p in _exact_gru()]
    one_by_one = _gru_grads(False, 8, monkeypatch)
    together = _gru_grads(True, 8, monkeypatch)
    assert _cos(together, exact) > 0.9999 and _cos(one_by_one, exact) > 0.9999
    # 2 bits: as close to the exact gradient as one record at a time (other random draws)
    two_alone, two_together = _gru_grads(False, 2, monkeypatch), _gru_grads(True, 2, monkeypatch)
    assert _cos(two_together, exact) > _cos(two_alone, exact) - 0.05

    packer = _packer()
    encodes, decodes = _calls(packer, monkeypatch, "encode_into"), _calls(packer, monkeypatch, "decode")
    singles = _calls(packer, monkeypatch, "encode")
    xs = [torch.randn(32, 128, requires_grad=True) for _ in range(100)]
    with torch.autograd.graph.saved_tensors_hooks(packer.pack, packer.unpack):
        loss = sum((x * x.detach().sin()).sum() for x in xs)  # each x saved by its mul
    packer.end_forward()
    assert isinstance(loss, torch.Tensor)
    loss.backward()
    # 100 x 4,096 values: two batches of BATCH_VALUES, one encode and one decode each
    assert encodes[0] == -(-100 * 4096 // BATCH_VALUES) and singles[0] == 0
    assert decodes[0] == encodes[0]
    errors = []
    for x in xs:
        assert x.grad is not None
        # the gradient of x * c is the saved c = sin(x), here at 2 bits: within one step of a
        # group's range (at most 2 / 3), and unbiased (stochastic rounding)
        errors.append(x.grad - x.detach().sin())
    error = torch.stack(errors)
    assert error.abs().max() <= 2 / 3 + 1e-5 and abs(float(error.mean())) < 2e-3


def _exact_gru() -> list[nn.Parameter]:
    torch.manual_seed(0)
    model = nn.GRU(16, 64, num_layers=2, batch_first=True)
    x = torch.randn(8, 12, 16)
    model(x)[0].square().mean().backward()
    return list(model.parameters())


def test_a_batched_record_is_right_before_and_after_its_batch_is_encoded() -> None:
    packer = _packer()  # every layer at 2 bits
    ts = [torch.randn(4, 256, requires_grad=True) * (i + 1) for i in range(3)]
    records = [packer.pack(t) for t in ts]
    assert all(isinstance(r, Saved) and isinstance(r.data, BatchRecord) for r in records)
    first = records[0].data
    assert isinstance(first, BatchRecord)
    # sized as one record from the start: the accounting is right before the encode
    assert first.nbytes == packed_nbytes(1024, 2, 256)
    assert packer._batches  # pending until a decode, the end of the forward or the step boundary
    outs = [packer.unpack(r) for r in records]
    assert not packer._batches
    for t, out in zip(ts, outs, strict=True):
        assert out.shape == t.shape and out.dtype == t.dtype
        step = (t.detach().amax() - t.detach().amin()) / 3
        assert (out - t.detach()).abs().max() <= step + 1e-6
    # the batch's buffers were cut to what it used: its records hold no unused tail
    assert first.buffers["payload"].untyped_storage().nbytes() == 3 * 1024 * 2 // 8
    # decoded alone (the path of a record with a region code) gives the same values
    codec = QuantizeCodec()
    assert all(torch.equal(codec.decode(r.data), out) for r, out in zip(records, outs, strict=True))


def test_the_tensors_a_batch_held_are_released_once_it_is_encoded() -> None:
    packer = _packer()
    t = torch.randn(8, 256, requires_grad=True)
    y = t * 2
    saved = packer.pack(y)
    ref = weakref.ref(y)
    packer.end_forward()
    del y
    gc.collect()
    assert ref() is None  # only the record is left
    assert isinstance(saved, Saved) and isinstance(saved.data, BatchRecord)
    batch = saved.data.batch
    assert batch is not None and batch.members == []


def test_a_member_changed_in_place_before_its_encode_raises_autograds_error() -> None:
    packer = _packer()
    a = torch.randn(4, 256, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(packer.pack, packer.unpack):
        y = a * 2
        z = y * y  # y saved, not yet encoded
        with torch.no_grad():
            y.add_(1)
    packer.end_forward()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()


def test_non_finite_values_come_back_in_place() -> None:
    packer = _packer()
    ts = [torch.randn(2, 256) for _ in range(3)]
    ts[1][0, 5], ts[1][1, 7], ts[2][0, 0] = float("nan"), float("inf"), -float("inf")
    records = [packer.pack(t.requires_grad_()) for t in ts]
    outs = [packer.unpack(r) for r in records]
    assert torch.isnan(outs[1][0, 5]) and outs[1][1, 7] == float("inf") and outs[2][0, 0] == -float("inf")
    assert torch.isfinite(outs[0]).all()
    for t, out in zip(ts, outs, strict=True):
        finite = torch.isfinite(t)
        values = t.detach()[finite]
        assert (out[finite] - values).abs().max() <= (values.max() - values.min()) / 3 + 1e-5


def test_half_precision_members_keep_their_dtype() -> None:
    packer = _packer()
    ts = [torch.randn(4, 256, dtype=dtype, requires_grad=True) for dtype in (torch.bfloat16, torch.float16)]
    records = [packer.pack(t) for t in ts]
    for t, r in zip(ts, records, strict=True):
        out = packer.unpack(r)
        assert out.dtype == t.dtype
        values = t.detach().float()
        assert (out.float() - values).abs().max() <= (values.max() - values.min()) / 3 * 1.01


def test_a_failing_batch_encode_keeps_its_members_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    tracker = ModuleTracker()
    tracker.model_depth = 1  # inside the model's forward
    fallbacks: list[str] = []
    packer = Packer(ControllerConfig(min_numel=0), tracker, lambda layer: (2.0, None),
                    lambda layer, exc: fallbacks.append(str(exc)))
    packer.begin_step(0)
    codec: Any = packer._codec("quantize")

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("injected codec failure")

    monkeypatch.setattr(codec, "encode_into", broken)
    t = torch.randn(4, 256, requires_grad=True)
    saved = packer.pack(t)
    out = packer.unpack(saved)
    assert torch.equal(out, t.detach())
    (rec,) = packer.finish_step().values()
    assert rec.packed_bytes == rec.raw_bytes and rec.numels == [] and rec.bit_values == 0
    assert fallbacks == ["injected codec failure"]


def test_which_records_join_a_batch() -> None:
    packer = _packer()
    small = packer.pack(torch.randn(4, 256, requires_grad=True))
    ragged = packer.pack(torch.randn(5, 100, requires_grad=True))  # not whole groups
    large = packer.pack(torch.randn(batches.BATCH_BELOW, requires_grad=True))
    relu = packer.pack(torch.relu(torch.randn(4, 256, requires_grad=True)))  # a region code
    kinds = [type(s.data).__name__ for s in (small, ragged, large, relu) if isinstance(s, Saved)]
    assert kinds == ["BatchRecord", "Packed", "Packed", "Packed"]
    forced = _packer(codec_impl="reference")  # a forced implementation encodes one by one
    one = forced.pack(torch.randn(4, 256, requires_grad=True))
    assert isinstance(one, Saved) and type(one.data).__name__ == "Packed"


def test_micro_batches_backward_in_any_order_read_their_own_batches() -> None:
    """Two forwards, then their backwards in reverse order: each record comes from its own batch."""
    torch.manual_seed(0)
    model = nn.GRU(16, 64, batch_first=True)
    xs = [torch.randn(8, 12, 16) for _ in range(2)]
    for x in xs:
        model(x)[0].square().mean().backward()
    exact = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    ctl = memctl.Controller(model, bits=8, min_numel=0, calibration_fraction=0.0, monitor_interval_s=0,
                            fused_rnn=False)  # the per-op path's batches
    losses = [model(x)[0].square().mean() for x in xs]
    for loss in reversed(losses):
        loss.backward()
    ctl.detach()
    got = [p.grad for p in model.parameters() if p.grad is not None]
    assert _cos(got, exact) > 0.9999


def test_a_member_changed_in_place_raises_even_once_its_tensor_is_gone() -> None:
    packer = _packer()
    a = torch.randn(4, 256, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(packer.pack, packer.unpack):
        y = a * 2
        z = y * y
        with torch.no_grad():
            y.add_(1)
    del y  # autograd's own check would need the tensor; the record keeps what it needs
    gc.collect()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()


def test_a_batch_norm_input_stored_again_is_never_encoded(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ Roots known from the last forward ]: from the second forward, the input that a batch
    norm's output is recomputed from is encoded once, in normalised coordinates, with the same
    records, bytes and statistics."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3))
    x = torch.randn(8, 3, 64, 64)  # 262,144 values a feature map: encoded alone, not batched
    reference = copy.deepcopy(model)
    ctl = memctl.Controller(model, bits=2.0, bit_choices=(2,), calibration_fraction=0.0, monitor_interval_s=0)
    encodes = _calls(ctl._packer, monkeypatch, "encode")
    counts, stats = [], []
    for _ in range(3):
        encodes[0] = 0
        model(x).square().mean().backward()
        reference(x).square().mean().backward()
        ctl.step()
        counts.append(encodes[0])
        s = ctl.stats()
        stats.append((s["packed_bytes"], {layer["name"]: layer["sensitivity"] for layer in s["layers"]}))
    assert counts[1] == counts[2] == counts[0] - 1  # the batch norm's input: one encode fewer
    assert stats[1][0] == stats[2][0] == stats[0][0]
    # the statistics still read the batch norm input's ranges (no optimizer: the same forward)
    assert stats[2][1]["1"] == pytest.approx(stats[0][1]["1"], rel=1e-3) and stats[2][1]["1"] > 0
    assert not ctl._packer._batches.deferred  # nothing left waiting
    assert _cos([p.grad for p in model.parameters()], [p.grad for p in reference.parameters()]) > 0.99
    ctl.detach()


def test_range_statistics_keep_a_layers_batched_records_and_drop_one_stored_again() -> None:
    """A layer's consecutive batched records make one run of groups; a record stored again
    leaves it, and the statistics read exactly the other records' group ranges."""
    packer = _packer()
    ts = [torch.randn(2, 256, requires_grad=True) * (i + 1) for i in range(3)]
    records = [packer.pack(t * 1) for t in ts]
    [(rec, runs)] = packer._metas.values()
    assert len(runs) == 1 and runs[0][1:] == [0, 6, 1]  # 3 records x 2 groups of 256, none merged
    middle = records[1].data
    assert isinstance(middle, BatchRecord)
    packer._drop_meta(rec, middle)  # what a raise to a floor does
    assert [r[1:] for r in runs] == [[0, 2, 1], [4, 6, 1]]
    packer.finish_step()
    kept = torch.cat([ts[0].detach().reshape(2, 256), ts[2].detach().reshape(2, 256)])
    spans = kept.amax(dim=1).double() - kept.amin(dim=1).double()
    assert float(rec.range_terms[0]) == pytest.approx(float(spans.dot(spans)) * 256, rel=1e-12)
    assert float(rec.mins[0]) == float(kept.min()) and float(rec.maxs[0]) == float(kept.max())
