"""Batch-norm outputs recomputed from the batch norm's input record (memctl/controller/normalized.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import memctl
from memctl.controller import derived, normalized, packing
from memctl.controller.derived import Derived, root_of, width_within
from tests.controller.draws import bias_over_noise
from tests.controller.packers import spy_records


class _Block(nn.Module):
    """conv -> BatchNorm -> activation -> conv."""

    def __init__(self, act: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.c1, self.bn, self.act = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), act()
        self.c2 = nn.Conv2d(16, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(self.act(self.bn(self.c1(x))))


def _run(model: nn.Module, bits: int | None, seed: int = 0) -> tuple[torch.Tensor, float]:
    """The gradient at the batch norm's input and the weight gradient of the batch norm and the layer
    after it: what reads the chain's records (not the first convolution's weight gradient, which
    reads only the image), of one batch (plain PyTorch when ``bits`` is None); and the packed bytes."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ctl = None
    if bits is not None:
        # head_bits=None: c2, the output layer, reads the chain's records at the same bits
        ctl = memctl.Controller(model, opt, bits=float(bits), bit_choices=(bits,), monitor_interval_s=0,
                                calibration_fraction=0.0, head_bits=None)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 3, 16, 16, generator=g)
    upstream = torch.randn(8, 8, 16, 16, generator=g)  # saved outside the model: kept exact
    grads: list[torch.Tensor] = []

    def watch(module: nn.Module, args: Any, out: torch.Tensor) -> None:
        out.register_hook(lambda grad: grads.append(grad.detach().flatten().clone()))

    handle = model.c1.register_forward_hook(watch)
    opt.zero_grad()
    (model(x) * upstream).sum().backward()
    handle.remove()
    packed = float("nan")
    if ctl is not None:
        opt.step()
        packed = float(ctl.stats()["packed_bytes"])
        ctl.detach()
    params = [p for name, p in model.named_parameters() if not name.startswith("c1.")]
    return torch.cat([*grads, *(p.grad.flatten().clone() for p in params if p.grad is not None)]), packed


def _model(act: Callable[[], nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    model = _Block(act)
    with torch.no_grad():  # a batch norm that is not the identity at init
        model.bn.weight.uniform_(0.5, 2.0)
        model.bn.bias.uniform_(-0.5, 0.5)
    return model


def _error(model: nn.Module, bits: int) -> tuple[float, float]:
    ref, _ = _run(model, None)
    got, packed = _run(model, bits)
    return float((got - ref).norm() / ref.norm()), packed


def _no_chains(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packing, "chain_of", lambda t: None)


@pytest.mark.parametrize("act", [nn.ReLU, lambda: nn.ReLU(inplace=True)])
def test_relu_after_batch_norm_is_read_finer_at_no_more_bytes(act: Callable[[], nn.Module],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ Batch-norm outputs recomputed from the input ]: ReLU's result read at 4 bits instead of 2."""
    joint, joint_bytes = _error(_model(act), 2)
    _no_chains(monkeypatch)
    separate, separate_bytes = _error(_model(act), 2)
    assert joint_bytes <= separate_bytes, (joint_bytes, separate_bytes)
    assert joint < 0.5 * separate, (joint, separate)


@pytest.mark.parametrize("act", [nn.Hardtanh, nn.Hardswish, lambda: nn.SiLU(inplace=True), nn.SELU,
                                 lambda: nn.Softshrink(0.3), nn.GELU])
def test_input_saving_activation_after_batch_norm_takes_fewer_bytes(act: Callable[[], nn.Module],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Three 2-bit records (z, x and y) become one 4-bit record: fewer bytes, the same reads (x and y
    were already read at 4 bits: NOTE [ Outputs recomputed from the input ])."""
    joint, joint_bytes = _error(_model(act), 2)
    _no_chains(monkeypatch)
    separate, separate_bytes = _error(_model(act), 2)
    assert joint_bytes < 0.93 * separate_bytes, (joint_bytes, separate_bytes)
    assert joint < 1.05 * separate, (joint, separate)


def test_batch_norm_output_keeps_no_payload_and_its_input_takes_the_bits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    records = spy_records(monkeypatch)
    _run(_model(nn.Hardtanh), 2)
    by_op: dict[str, Any] = {}
    for name, saved in records:
        by_op.setdefault(name, saved)  # the first: c2's output is saved at the end too
    z, x, y = by_op["ConvolutionBackward0"], by_op["NativeBatchNormBackward0"], by_op["HardtanhBackward0"]
    # z's record is read from its normalised coordinates, and so are x's and y's
    root = root_of(z)
    assert isinstance(z.data, Derived) and root is not z
    assert isinstance(x.data, Derived) and root_of(x) is root
    assert isinstance(y.data, Derived) and y.data.source is x and root_of(y) is root
    assert int(root.data.params["bits"]) == 4  # 2 + 2 + 2 bits, within the codec's widths
    assert [r.partition.op for r in x.regions] == ["hardtanh"]


def _relu_chain() -> tuple[nn.Module, list[torch.Tensor], torch.optim.Optimizer, memctl.Controller]:
    """conv -> BatchNorm -> in-place ReLU -> conv at 2 bits, its weights fixed (lr 0), with the
    ReLU results of every forward captured."""
    model = _model(lambda: nn.ReLU(inplace=True))
    captured: list[torch.Tensor] = []
    model.act.register_forward_hook(lambda m, a, out: captured.append(out.detach().clone()))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ctl = memctl.Controller(model, opt, bits=2.0, bit_choices=(2,), monitor_interval_s=0,
                            calibration_fraction=0.0)
    return model, captured, opt, ctl


def test_relu_after_batch_norm_keeps_exact_zeros(monkeypatch: pytest.MonkeyPatch) -> None:
    records = spy_records(monkeypatch)
    model, captured, _, ctl = _relu_chain()
    model(torch.randn(8, 3, 16, 16)).square().mean().backward()
    y = next(saved for name, saved in records if name == "ReluBackward0")
    assert isinstance(y.data, Derived)
    decoded = ctl._packer.unpack(y)
    ctl.detach()
    assert torch.equal(decoded == 0, captured[0] == 0)
    assert bool((decoded[captured[0] > 0] > 0).all())


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("act", [nn.ReLU, nn.Hardswish, nn.SiLU, nn.GELU, nn.Hardtanh])
def test_a_chain_is_never_read_coarser_than_its_own_records(act: Callable[[], nn.Module], bits: int,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """At 4 + 4 bits an 8-bit root costs more bytes than the two 4-bit records (NOTE [ Eight-bit
    groups ]): an activation's result keeps its own record then, rather than be read from a 4-bit
    root of the batch norm's input, twice as coarse (ReLU's directly, the others' rebuilt from
    the batch norm's output, itself read from that root); never more bytes than separate records."""
    joint, joint_bytes = _error(_model(act), bits)
    _no_chains(monkeypatch)
    separate, separate_bytes = _error(_model(act), bits)
    assert joint <= 1.05 * separate, (joint, separate)
    assert joint_bytes <= separate_bytes, (joint_bytes, separate_bytes)


def _cuda_relu_read(train: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[float, bool]:
    """ReLU's result after a cuDNN batch norm read back at 2 bits: relative error, and whether its
    record was derived."""
    records = spy_records(monkeypatch)
    model = _model(nn.ReLU).cuda().train(train)
    captured: list[torch.Tensor] = []
    model.act.register_forward_hook(lambda m, a, out: captured.append(out.detach().clone()))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ctl = memctl.Controller(model, opt, bits=2.0, bit_choices=(2,), monitor_interval_s=0,
                            calibration_fraction=0.0)
    g = torch.Generator().manual_seed(0)
    model(torch.randn(8, 3, 16, 16, generator=g).cuda()).square().mean().backward()
    y = next(saved for name, saved in records if name == "ReluBackward0")
    decoded = ctl._packer.unpack(y)
    ctl.detach()
    return float((decoded - captured[0]).norm() / captured[0].norm()), isinstance(y.data, Derived)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a real CUDA device")
@pytest.mark.parametrize("train", [True, False])
def test_cudnn_batch_norm_chain_is_derived_on_a_gpu(train: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the batch norm's node is cuDNN's: the chain forms there too, and reads ReLU's result
    finer than its own 2-bit record would (from the 4-bit root)."""
    joint, derived_ = _cuda_relu_read(train, monkeypatch)
    assert derived_
    _no_chains(monkeypatch)
    separate, derived_ = _cuda_relu_read(train, monkeypatch)
    assert not derived_
    assert joint < 0.5 * separate, (joint, separate)


def test_frozen_bias_under_relu_is_not_derived(monkeypatch: pytest.MonkeyPatch) -> None:
    records = spy_records(monkeypatch)
    model = _model(nn.ReLU)
    model.bn.bias.requires_grad_(False)
    _run(model, 2)
    y = next(saved for name, saved in records if name == "ReluBackward0")
    assert not isinstance(y.data, Derived)


def test_a_chain_function_that_misses_the_output_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wrong bias: ReLU's result keeps its own record, as with no chains at all (the batch norm's
    input normalised in neither run: NOTE [ Batch-norm inputs normalised when no record reads the
    output ])."""
    monkeypatch.setattr(normalized, "_bias", lambda node: torch.zeros(16) + 0.25)
    monkeypatch.setattr(packing.Packer, "_watch_unread", lambda self, t: None)
    wrong_grad, wrong_bytes = _run(_model(nn.ReLU), 2)
    _no_chains(monkeypatch)
    separate_grad, separate_bytes = _run(_model(nn.ReLU), 2)
    assert wrong_bytes == separate_bytes
    assert torch.equal(wrong_grad, separate_grad)


def test_output_of_an_op_reading_node_fields_while_packing_is_still_derived(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """PReLU's output function reads the node's saved weight (an unpack) inside the pack hook: that
    read must not end the forward's matching (NOTE [ Finding the op that saved a tensor ])."""
    records = spy_records(monkeypatch)
    _run(_model(nn.PReLU), 2)
    y = next(saved for name, saved in records if name == "PreluKernelBackward0")
    assert isinstance(y.data, Derived)


def _rebuilding(z: torch.Tensor, t: torch.Tensor) -> tuple[Any, Any, Any]:
    """The functions of the chain ending at ``t``, checked to rebuild ``t`` and its input ``z``."""
    chain = normalized.chain_of(t)
    assert chain is not None
    fns = chain.functions(z.detach(), t)
    assert fns is not None
    normalise, z_of, t_of = fns
    assert normalized.verified(lambda v: t_of(normalise(v)), z.detach(), t)
    assert normalized.verified(lambda v: z_of(normalise(v)), z.detach(), z.detach())
    return normalise, z_of, t_of


@settings(max_examples=40, deadline=None)
@given(
    shape=st.sampled_from([(4, 3), (2, 3, 5), (2, 3, 4, 4), (1, 3, 2, 2, 2)]),
    training=st.booleans(),
    affine=st.booleans(),
    after=st.sampled_from(["none", "clone", "relu", "relu_"]),
    seed=st.integers(0, 2**16),
)
def test_chain_functions_rebuild_the_input_and_the_output(shape: tuple[int, ...], training: bool,
                                                         affine: bool, after: str, seed: int) -> None:
    """Training and eval mode, with and without affine parameters, the batch norm's output itself, the
    clone an in-place activation saves, and ReLU (in place or not) after it."""
    g = torch.Generator().manual_seed(seed)
    kind = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}[len(shape)]
    bn = kind(3, affine=affine)
    with torch.no_grad():
        if affine:
            bn.weight.copy_(torch.rand(3, generator=g) * 2.0 - 0.5)
            bn.bias.copy_(torch.randn(3, generator=g))
        bn.running_mean.copy_(torch.randn(3, generator=g))
        bn.running_var.copy_(torch.rand(3, generator=g) + 0.5)
    bn.train(training)
    z = (torch.randn(shape, generator=g) * 3.0 + 1.0).requires_grad_(True) * 1.0
    x = bn(z)
    ops = {"none": lambda: x, "clone": x.clone, "relu": lambda: torch.relu(x),
           "relu_": lambda: torch.relu_(x)}
    t = ops[after]()
    normalise = _rebuilding(z, t)[0]
    if training:  # the normalised coordinates have each channel's batch mean 0 and variance 1
        n = normalise(z.detach()).transpose(0, 1).reshape(3, -1)
        torch.testing.assert_close(n.mean(1), torch.zeros(3), atol=1e-4, rtol=0)


@pytest.mark.parametrize("after", ["none", "relu"])
def test_chain_functions_off_the_cpu_use_no_fused_pass(after: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the fused channel passes (CPU kernels) cannot run, the chain builds no vectors for them
    (two launches a chain and step on a GPU) and offers no channel map; its functions rebuild the
    input and the output all the same, by PyTorch ops."""
    monkeypatch.setattr(normalized, "_fused_on", lambda t: False)
    g = torch.Generator().manual_seed(3)
    bn = nn.BatchNorm2d(3)
    with torch.no_grad():
        bn.weight.copy_(torch.rand(3, generator=g) + 0.5)
        bn.bias.copy_(torch.randn(3, generator=g))
    z = (torch.randn(2, 3, 4, 4, generator=g) * 3.0 + 1.0).requires_grad_(True) * 1.0
    x = bn(z)
    t = torch.relu(x) if after == "relu" else x
    normalise, z_of, t_of = _rebuilding(z, t)
    assert z_of.channel_map(False) is None and t_of.channel_map(True) is None
    assert t_of.masked(normalise(z.detach()), torch.zeros(12, dtype=torch.uint8), 0.0) is None


class _Deep(nn.Module):
    """A late block of a small-input CNN: 2x2 positions, so a quantisation group spans 64 channels, whose
    scales differ by 1000x before the batch norm."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.bn, self.act = nn.Conv2d(64, 64, 1), nn.BatchNorm2d(64), nn.Hardswish()
        self.c2 = nn.Conv2d(64, 8, 1)
        with torch.no_grad():
            self.c1.weight.mul_(torch.logspace(-1.5, 1.5, 64).view(64, 1, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(self.act(self.bn(self.c1(x))))


def _deep_error(bits: int) -> float:
    torch.manual_seed(0)
    model = _Deep()
    g = torch.Generator().manual_seed(0)
    x, upstream = torch.randn(64, 64, 2, 2, generator=g), torch.randn(64, 8, 2, 2, generator=g)
    grads = []
    for b in (None, bits):
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        ctl = None
        if b is not None:
            ctl = memctl.Controller(model, opt, bits=float(b), bit_choices=(b,), monitor_interval_s=0,
                                    calibration_fraction=0.0, keep_inputs=True)  # the input exact
        opt.zero_grad()
        (model(x) * upstream).sum().backward()
        if ctl is not None:
            ctl.detach()
        grads.append(torch.cat([p.grad.flatten().clone() for p in model.parameters() if p.grad is not None]))
    return float((grads[1] - grads[0]).norm() / grads[0].norm())


@pytest.mark.parametrize("bits", [8, 2])
def test_normalised_coordinates_keep_every_channel_at_its_own_scale(bits: int,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A record of z itself (monkeypatched: mean 0 and invstd 1, the affine map folded into weight and
    bias) quantises small channels on the scale of the group's largest; the normalised one does not."""
    normalised = _deep_error(bits)
    statistics = normalized._statistics

    def raw_coordinates(node: Any, z: torch.Tensor, x: torch.Tensor | None) -> Any:
        got = statistics(node, z, x)
        if got is None:
            return None
        mean, invstd, gamma, beta = got
        a = gamma * invstd
        return torch.zeros_like(mean), torch.ones_like(invstd), a, beta - mean * a

    monkeypatch.setattr(normalized, "_statistics", raw_coordinates)
    assert normalised < 0.5 * _deep_error(bits)


def test_chain_ends_only_at_batch_norm_outputs() -> None:
    z = torch.randn(4, 3, 5, requires_grad=True) * 1.0
    assert normalized.chain_of(torch.relu(z)) is None
    assert normalized.chain_of(F.layer_norm(z, (5,))) is None
    x = nn.BatchNorm1d(3)(z)
    assert normalized.chain_of(torch.relu(x)[:, :2]) is None  # a view between
    assert normalized.chain_of(torch.sigmoid(x)) is None  # an op not in the table


def test_width_within() -> None:
    assert [width_within(b) for b in (1, 2, 3, 4, 5, 6, 7, 8, 12, 16)] == [1, 2, 2, 4, 4, 4, 4, 8, 8, 8]
    assert derived.DERIVED_MAX_BITS == 8


def test_sixteen_bits_of_a_chain_are_kept_in_half_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    """At 8 bits, z's and x's records together hold 16 bits per value: the normalised record is kept
    in half precision (never more bytes than the 8-bit records), and the gradient error falls."""
    records = spy_records(monkeypatch)
    wide = _deep_error(8)
    root = root_of(next(saved for name, saved in records if name == "ConvolutionBackward0"))
    assert isinstance(root.data, torch.Tensor) and root.data.dtype == torch.float16
    monkeypatch.setattr(packing, "WIDE_BITS", 10**6)
    assert wide < 0.2 * _deep_error(8)


def test_derived_ranges_are_measured_on_the_steps_that_keep_ranges(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ Range statistics ]: a derived record's group ranges take a pass over the tensor,
    made on the steps that keep ranges (NOTE [ Range statistics on the steps that gather
    statistics ]: with a re-solve every 5 steps, 0, 1, 4, 5 and 9) and on no other."""
    calls: list[int] = []
    group_ranges = packing._group_ranges
    derived_stats = packing.Packer._derived_range_stats
    inside = [False]

    def counting(flat: torch.Tensor, g: int) -> tuple[torch.Tensor, torch.Tensor]:
        if inside[0]:  # (a batch whose records were all stored again takes its ranges too)
            calls.append(flat.numel())
        return group_ranges(flat, g)

    def derived_range_stats(self: packing.Packer, *args: Any) -> None:
        inside[0] = True
        try:
            derived_stats(self, *args)
        finally:
            inside[0] = False

    monkeypatch.setattr(packing, "_group_ranges", counting)
    monkeypatch.setattr(packing.Packer, "_derived_range_stats", derived_range_stats)
    model = _model(nn.ReLU)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ctl = memctl.Controller(model, opt, bits=2.0, bit_choices=(2,), monitor_interval_s=0,
                            calibration_fraction=0.0, allocation_interval=5)
    packer = ctl._packer
    terms: list[int] = []
    fold = packer.finish_step

    def finish() -> dict[str, Any]:
        records = fold()
        terms.append(sum(len(rec.range_terms) for rec in records.values()))
        return records

    monkeypatch.setattr(packer, "finish_step", finish)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 3, 16, 16, generator=g)
    per_step: list[int] = []
    for _ in range(10):
        before = len(calls)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        per_step.append(len(calls) - before)
    ctl.detach()
    ranging = [0, 1, 4, 5, 9]
    assert per_step[0] > 0  # the chain's derived records
    assert all(per_step[i] == per_step[0] for i in ranging), per_step
    assert all(per_step[i] == 0 for i in range(10) if i not in ranging), per_step
    # the steps that keep ranges keep every record's, the others none
    assert all(terms[i] == terms[0] > 0 for i in ranging) and all(terms[i] == 0 for i in range(10)
                                                                   if i not in ranging), terms


def _reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, torch.Tensor]]:
    """Every read of a ReLU result rebuilt from its chain, with the backward node that read it."""
    out: list[tuple[str, torch.Tensor]] = []
    for_reader = packing.Packer._for_reader

    def spy(self: packing.Packer, values: torch.Tensor, code: Any, dtype: torch.dtype) -> torch.Tensor:
        got = for_reader(self, values, code, dtype)
        node = torch._C._current_autograd_node()
        out.append((type(node).__name__ if node is not None else "", got.detach().clone()))
        return got

    monkeypatch.setattr(packing.Packer, "_for_reader", spy)
    return out


def test_the_next_convolution_reads_a_relu_result_unbiased(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ Unbiased reads of a ReLU result ]: averaged over the codec's draws, the values the
    next convolution reads are the ReLU result's; the ReLU's own backward reads them projected
    onto the mask, whose clamp at the floor biases small positives upwards."""
    reads = _reads(monkeypatch)
    model, captured, opt, ctl = _relu_chain()
    x = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    draws = 120
    for _ in range(draws):  # the weights stay (lr 0); each step draws the codec's rounding anew
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    ctl.detach()
    t = captured[0]
    assert all(torch.equal(c, t) for c in captured)
    conv = [r for name, r in reads if name == "ConvolutionBackward0"]
    relu = [r for name, r in reads if name == "ReluBackward0"]
    assert len(conv) == len(relu) == draws
    on = t > 0
    for r in relu:  # the ReLU's backward reads the exact sign pattern
        assert torch.equal(r > 0, on)
    for r in conv:  # the convolution's reads are exact zeros off the mask, unclamped on it
        assert bool((r[~on] == 0).all())
    assert any(bool((r[on] < 0).any()) for r in conv)
    conv_mean, relu_mean = torch.stack(conv).mean(0), torch.stack(relu).mean(0)
    small = on & (t < t[on].quantile(0.25))  # where the clamp acts
    conv_bias = float((conv_mean - t)[small].mean())
    relu_bias = float((relu_mean - t)[small].mean())
    spread = float(torch.stack(conv)[:, small].sub(t[small]).std())
    se = spread / (draws * int(small.sum())) ** 0.5
    assert relu_bias > 20 * se  # the projected reads are biased: the test can see a bias
    assert abs(conv_bias) < 4 * se, (conv_bias, se, relu_bias)


@pytest.mark.parametrize("path", ["decode_affine", "channels", "torch"])
def test_unclamped_reads_are_the_same_on_every_decode_path(path: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused decode, the channel map after the decode and the PyTorch ops (a GPU's path) give the
    convolution the same unclamped values: bit for bit, and to rounding on the PyTorch path, whose
    ``addcmul`` may round ``n·weight + bias`` once."""
    from memctl.codecs.quantize.codec import QuantizeCodec

    reads = _reads(monkeypatch)
    ref, _ = _run(_model(lambda: nn.ReLU(inplace=True)), 2)
    first = [r for name, r in reads if name == "ConvolutionBackward0"]
    reads.clear()
    monkeypatch.setattr(QuantizeCodec, "decode_affine", lambda self, *args, **kwargs: None)
    if path == "torch":
        monkeypatch.setattr(normalized.channels, "affine", lambda *args, **kwargs: None)
    got, _ = _run(_model(lambda: nn.ReLU(inplace=True)), 2) if path != "decode_affine" else (ref, 0.0)
    again = [r for name, r in reads if name == "ConvolutionBackward0"] if path != "decode_affine" else first
    assert first and len(first) == len(again)
    assert any(bool((r < 0).any()) for r in again)
    if path == "torch":
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(first, again, strict=True))
        assert float((got - ref).norm() / ref.norm()) < 1e-5
        return
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert torch.equal(got, ref)


def test_max_pooling_takes_the_unclamped_values_and_the_same_gradient(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Max pooling's backward reads only its input's shape, so it takes the held values as they are
    (no projected copy), and the gradient is what the projected copy gave."""

    class Pooled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = _model(lambda: nn.ReLU(inplace=True))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b = self.block
            return b.c2(F.max_pool2d(b.act(b.bn(b.c1(x))), 2))

    def gradient() -> torch.Tensor:
        torch.manual_seed(0)
        model = Pooled()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        ctl = memctl.Controller(model, opt, bits=2.0, bit_choices=(2,), monitor_interval_s=0,
                                calibration_fraction=0.0)
        x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))
        model(x).square().mean().backward()
        ctl.detach()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    reads = _reads(monkeypatch)
    got = gradient()
    pooled = [r for name, r in reads if name == "MaxPool2DWithIndicesBackward0"]
    assert pooled and any(bool((r < 0).any()) for r in pooled)  # the unclamped values
    monkeypatch.setattr(packing, "_VALUE_READERS", packing._VALUE_READERS - {"MaxPool2DWithIndicesBackward0"})
    assert torch.equal(gradient(), got)


def _batch_norm_weight_draws(act: Callable[[], nn.Module], draws: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch norm's weight gradient of ``_Block(act)`` at fixed weights: exact, and one row per
    draw of the codec's rounding at 2 bits (the first step's draw left out: it chains, having no
    hint from a forward before it)."""
    model = _model(act)
    x = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model(x).square().mean().backward()
    exact = model.bn.weight.grad.clone()
    opt.zero_grad()
    ctl = memctl.Controller(model, opt, bits=2.0, bit_choices=(2,), monitor_interval_s=0,
                            calibration_fraction=0.0)
    rows = []
    for _ in range(draws + 1):  # the weights stay (lr 0); each step draws the codec's rounding anew
        model(x).square().mean().backward()
        rows.append(model.bn.weight.grad.clone())
        opt.step()
        opt.zero_grad()
    ctl.detach()
    return exact, torch.stack(rows[1:])


@pytest.mark.parametrize("act", [nn.Hardswish, nn.SiLU, nn.ELU])
def test_a_value_dependent_activation_does_not_share_the_batch_norm_input_record(
        act: Callable[[], nn.Module], monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ No chain into a value-dependent derivative ]: from the second forward on, such an
    activation's input is a record of its own, and the batch norm's weight gradient is unbiased;
    chained as before (the hints switched off) it is biased far beyond the draws' noise."""
    records = spy_records(monkeypatch)
    exact, rows = _batch_norm_weight_draws(act, draws=96)
    kinds = [(name, type(saved.data).__name__) for name, saved in records]
    per_step = len(kinds) // 97
    first, later = kinds[:per_step], kinds[-per_step:]
    assert ("NativeBatchNormBackward0", "Derived") in first  # the first forward chains
    assert not any(name == "NativeBatchNormBackward0" and kind == "Derived" for name, kind in later)
    assert bias_over_noise(exact, rows) < 3.0
    monkeypatch.setattr(packing, "VALUE_DEPENDENT", frozenset())
    chained_exact, chained = _batch_norm_weight_draws(act, draws=96)
    assert torch.equal(chained_exact, exact)
    assert bias_over_noise(exact, chained) > 20.0


class _ScaleBranch(nn.Module):
    """MobileOne's scale branch, or a ResNet's block end: a depthwise 1x1 convolution whose
    channels differ in scale by three orders of magnitude, then a batch norm whose output goes
    into a sum (no record reads it), on 2x2 feature maps (a quantisation group spans channels)."""

    def __init__(self, channels: int = 32) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 1, groups=channels, bias=False)
        self.bn = nn.BatchNorm2d(channels)
        with torch.no_grad():
            self.conv.weight.copy_(torch.logspace(0, -3, channels).view(-1, 1, 1, 1))
            self.bn.weight.uniform_(0.5, 2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x)) + x


def _branch_error(bits: int, seed: int = 0) -> float:
    """The batch norm's weight gradient's relative error at ``bits``."""
    torch.manual_seed(0)
    model = _ScaleBranch()
    x = torch.randn(256, 32, 2, 2, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()
    ref = model.bn.weight.grad.clone()
    model.zero_grad()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ctl = memctl.Controller(model, opt, bits=float(bits), bit_choices=(bits,), monitor_interval_s=0,
                            calibration_fraction=0.0)
    model(x).square().mean().backward()
    ctl.detach()
    return float((model.bn.weight.grad - ref).norm() / ref.norm())


@pytest.mark.parametrize("bits", [8, 2])
def test_a_batch_norm_input_no_record_reads_is_normalised(bits: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ Batch-norm inputs normalised when no record reads the output ]: the input's record holds
    ``(z - mean)·invstd``, so the small channels keep their own precision; in the input's own
    coordinates their values took the step of the group's largest channel, and the batch norm's
    weight gradient read them through ``invstd``."""
    records = spy_records(monkeypatch)
    normalised = _branch_error(bits)
    z = next(saved for name, saved in records if name == "ConvolutionBackward0")
    assert isinstance(z.data, Derived) and getattr(z.data.fn, "normalised", False)
    records.clear()
    monkeypatch.setattr(packing.Packer, "_watch_unread", lambda self, t: None)
    raw = _branch_error(bits)
    z = next(saved for name, saved in records if name == "ConvolutionBackward0")
    assert not isinstance(z.data, Derived)
    assert normalised < 0.25 * raw, (normalised, raw)
    assert normalised < (0.01 if bits == 8 else 0.5), normalised



def test_replays_normalise_the_batch_norm_input_as_training_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ Replay ]: a replay's module outputs go to the replay's own packer, so a calibration
    probe measures the records training makes (here, the batch norm's input in normalised
    coordinates; before, the replays kept it in its own and measured what training no longer did)."""
    seen: list[tuple[int, Any]] = []
    pack_new = packing.Packer._pack_new

    def spy(self: packing.Packer, t: torch.Tensor, layer: str, *rest: Any) -> Any:
        saved = pack_new(self, t, layer, *rest)
        if type(t.grad_fn).__name__ == "ConvolutionBackward0":
            seen.append((id(self), saved))
        return saved

    monkeypatch.setattr(packing.Packer, "_pack_new", spy)
    torch.manual_seed(0)
    model = _ScaleBranch()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ctl = memctl.Controller(model, opt, bits=2.0, bit_choices=(2,), monitor_interval_s=0)
    x = torch.randn(256, 32, 2, 2, generator=torch.Generator().manual_seed(0))
    model(x).square().mean().backward()
    opt.step()
    probes = ctl.stats()["calibration"]["probes"]
    ctl.detach()
    compressed = [(packer, saved) for packer, saved in seen if not isinstance(saved.data, torch.Tensor)]
    assert probes >= 1 and len({packer for packer, _ in compressed}) >= 2  # training's packer and a replay's
    assert all(isinstance(saved.data, Derived) and getattr(saved.data.fn, "normalised", False)
               for _, saved in compressed)


def test_a_batch_norm_input_whose_groups_lie_in_one_channel_keeps_its_coordinates(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """16x16 positions a channel: every group of 256 (2 bits) lies in one channel and has its own
    step already, so the record is not encoded again (NOTE [ Batch-norm inputs normalised ... ])."""
    records = spy_records(monkeypatch)
    torch.manual_seed(0)
    model = _ScaleBranch(8)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ctl = memctl.Controller(model, opt, bits=2.0, bit_choices=(2,), monitor_interval_s=0,
                            calibration_fraction=0.0)
    model(torch.randn(16, 8, 16, 16)).square().mean().backward()
    ctl.detach()
    z = next(saved for name, saved in records if name == "ConvolutionBackward0")
    assert not isinstance(z.data, (Derived, torch.Tensor))
