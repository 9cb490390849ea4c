"""Log-softmax outputs stored as probabilities (NOTE [ Log-probabilities ], memctl/controller/logprobs.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import memctl
from memctl.codecs import get
from memctl.controller.config import ControllerConfig
from memctl.controller.logprobs import LogProbs, decode_log_probs, encode_log_probs
from memctl.controller.packing import Packer, Saved
from memctl.errors import ConfigError
from tests.controller.draws import bias_over_noise
from tests.controller.packers import strict_packer


def _packer(**config: object) -> Packer:
    return strict_packer(ControllerConfig(**config))  # type: ignore[arg-type]


def _logits(rows: int = 64, vocab: int = 512, seed: int = 0, scale: float = 6.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(rows, vocab, generator=g)).requires_grad_()


def test_log_softmax_output_is_stored_quantised_not_copied() -> None:
    y = F.log_softmax(_logits(), dim=-1)
    packer = _packer()
    saved = packer.pack(y)
    assert isinstance(saved, Saved) and saved.data is not None
    packer.end_forward()  # inside a model's forward the record is encoded when the forward ends
    assert isinstance(saved.data, LogProbs)
    raw = y.numel() * y.element_size()
    assert saved.data.nbytes < raw / 6.5  # 4 bits per value plus group metadata and the exact largest
    (rec,) = packer.finish_step().values()
    assert rec.raw_bytes == raw
    assert rec.fixed_bytes == rec.packed_bytes == saved.data.nbytes


def test_log_prob_bits_none_keeps_them_exact() -> None:
    y = F.log_softmax(_logits(), dim=-1)
    saved = _packer(log_prob_bits=None).pack(y)
    assert isinstance(saved, Saved) and isinstance(saved.data, torch.Tensor)
    assert torch.equal(saved.data, y.detach())


@pytest.mark.parametrize("value", [3, 16, True])
def test_log_prob_bits_is_validated(value: object) -> None:
    with pytest.raises(ConfigError, match="log_prob_bits"):
        ControllerConfig(log_prob_bits=value)  # type: ignore[arg-type]


def test_decoded_values_stay_finite_and_within_their_group() -> None:
    y = F.log_softmax(_logits(scale=12.0), dim=-1).detach()  # many probabilities round to 0
    codec = get("quantize")
    rec = encode_log_probs(y, codec, 8, seed=3, group=256)
    out = decode_log_probs(rec, codec, y.shape, y.dtype)
    assert out.shape == y.shape and out.dtype == y.dtype
    assert torch.isfinite(out).all()
    groups, got = y.reshape(-1, 256), out.reshape(-1, 256)
    assert (got >= groups.amin(dim=1, keepdim=True)).all()
    assert (got <= groups.amax(dim=1, keepdim=True) + 1e-6).all()
    # each row's most likely token (its group's largest probability) comes back exact
    top = groups.argmax(dim=1)
    rows = torch.arange(groups.shape[0])
    assert torch.allclose(got[rows, top], groups[rows, top], rtol=0, atol=1e-6)


@pytest.mark.parametrize("bits", [4, 8])
def test_confident_rows_keep_the_rest_on_the_scale_of_what_is_left(bits: int) -> None:
    """A group's largest probability is kept exact and the others are quantised on the range they
    span: a confident token (p = 0.99) no longer sets the step for the 0.01 left to the others."""
    logits = _logits(rows=64, vocab=256, scale=1.0).detach()
    logits[torch.arange(64), torch.arange(64) * 3] += 12.0  # one token per row near certain
    y = F.log_softmax(logits, dim=-1)
    codec = get("quantize")
    got = decode_log_probs(encode_log_probs(y, codec, bits, seed=2, group=256), codec, y.shape, y.dtype).exp()
    p = y.exp()
    top = p.argmax(dim=1)
    rows = torch.arange(64)
    assert torch.allclose(got[rows, top], p[rows, top], rtol=1e-6, atol=0)
    rest = p.clone()
    rest[rows, top] = 0.0
    step = rest.amax(dim=1, keepdim=True) / (2**bits - 1)  # the rest's range (its minimum is ~0)
    assert ((got - p).abs() <= step * 1.001 + 1e-7).all()
    assert float(step.max()) < float(p[rows, top].min()) / (2**bits - 1) / 20  # 20x finer than before


def test_groups_wider_than_int16_places_keep_their_largest_exact() -> None:
    y = F.log_softmax(_logits(rows=2, vocab=40960, scale=6.0), dim=-1).detach()
    codec = get("quantize")
    rec = encode_log_probs(y, codec, 4, seed=0, group=40960)  # a place past 2^15 in each group
    assert rec.top_at.dtype == torch.int32
    got = decode_log_probs(rec, codec, y.shape, y.dtype)
    top = y.argmax(dim=1)
    assert bool((top > 2**15).any())
    assert torch.allclose(got[torch.arange(2), top], y[torch.arange(2), top], atol=1e-6, rtol=0)


def test_masked_and_nan_values_come_back_as_they_were() -> None:
    logits = torch.randn(8, 512)
    logits[:, 100:200] = -torch.inf  # a masked vocabulary
    y = F.log_softmax(logits, dim=-1)
    y[0, 5] = torch.nan
    codec = get("quantize")
    out = decode_log_probs(encode_log_probs(y, codec, 8, seed=1, group=256), codec, y.shape, y.dtype)
    assert torch.isneginf(out[:, 100:200]).all()
    assert torch.isnan(out[0, 5])
    # groups without a masked entry come back finite; in a group holding one, a probability
    # that rounds to 0 cannot be told from it and reads -inf too (never NaN or +inf)
    assert torch.isfinite(out[:, 256:]).all()
    head = out[:, :100].flatten()
    assert (torch.isfinite(head) | torch.isneginf(head)).sum() == 8 * 100 - 1


def _cross_entropy_draws(rows: int, scale: float, bits: int, draws: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cross-entropy gradient of ``rows`` random logit rows: plain, and one row per draw of
    the log-probabilities' rounding at ``bits``."""
    logits = _logits(rows=rows, scale=scale)
    target = torch.randint(0, 512, (rows,), generator=torch.Generator().manual_seed(1))
    F.cross_entropy(logits, target).backward()
    plain = logits.grad.clone()
    logits.grad = None
    grads = []
    for seed in range(draws):
        packer = _packer(log_prob_bits=bits)
        packer.begin_step(seed)
        with torch.autograd.graph.saved_tensors_hooks(packer.pack, packer.unpack):
            loss = F.cross_entropy(logits, target)
        packer.end_forward()
        loss.backward()
        grads.append(logits.grad.clone())
        logits.grad = None
    return plain, torch.stack(grads)


@pytest.mark.parametrize(("bits", "least_cosine"), [(4, 0.9995), (8, 0.9999)])
def test_cross_entropy_gradient_is_unbiased_and_close(bits: int, least_cosine: float) -> None:
    """Log-softmax's backward is linear in exp(y): the mean over seeds converges to plain's."""
    plain, grads = _cross_entropy_draws(32, 4.0, bits, 64)
    one, mean = grads[0], grads.mean(0)
    cos = float(F.cosine_similarity(one.flatten().double(), plain.flatten().double(), dim=0))
    assert cos > least_cosine  # (one draw; 0.99988 at 4 bits)
    # averaging 64 draws shrinks the error ~8x (unbiased); a biased scheme would not shrink
    assert (mean - plain).norm() < 0.25 * (one - plain).norm()


def test_the_smallest_probabilities_are_read_unbiased() -> None:
    """NOTE [ Log-probabilities ], "the range of the rest": no value rounds below its group's
    smallest, so none is raised back to it. Flat rows (as at initialisation), where the smallest
    probability is not far below the others: the gradient's mean over 256 draws is the exact one
    within the draws' noise, value by value (1.05; with the range from 0, 3.9)."""
    plain, grads = _cross_entropy_draws(16, 0.3, 4, 256)
    assert bias_over_noise(plain, grads) < 2.0


def test_a_language_model_head_under_the_controller() -> None:
    """End to end: the ratio counts the 8-bit record, the gradient stays close to plain's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(512, 64), torch.nn.Linear(64, 512))
    tokens = torch.randint(0, 512, (16, 32))

    def loss_of(m: torch.nn.Module) -> torch.Tensor:
        out = m(tokens)
        return F.cross_entropy(out.reshape(-1, 512), tokens.reshape(-1))

    import copy

    ref = copy.deepcopy(model)
    loss_of(ref).backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the step only ends the controller's step
    results = {}
    for bits in (8, None):
        ctl = memctl.Controller(model, opt, bits=8.0, monitor_interval_s=0, log_prob_bits=bits,
                                calibration_fraction=0)
        loss_of(model).backward()
        g = torch.cat([p.grad.flatten() for p in model.parameters()]).double()
        r = torch.cat([p.grad.flatten() for p in ref.parameters()]).double()
        opt.step()
        stats = ctl.stats()
        results[bits] = (float(g @ r / (g.norm() * r.norm())), stats["raw_bytes"] / stats["packed_bytes"])
        ctl.detach()
        opt.zero_grad(set_to_none=True)
    assert results[8][0] > 0.9999
    assert results[8][1] > 2.0 * results[None][1]  # the log-probabilities dominate the saved bytes


# -- NOTE [ Rows no loss reads ] ----------------------------------------------------------------
class _MaskedLM(torch.nn.Module):
    """A masked language model that computes its loss in its forward, as Hugging Face models do."""

    def __init__(self, extra: bool = False, softmax_dim: int = -1) -> None:
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(512, 64), torch.nn.Linear(64, 512)
        self.extra, self.softmax_dim = extra, softmax_dim

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.embed(tokens)).reshape(-1, 512)
        if self.softmax_dim != -1:  # a softmax across rows: every row's values reach the gradient
            logp = F.log_softmax(logits, dim=self.softmax_dim)
            return F.nll_loss(logp, labels.reshape(-1), ignore_index=-100)
        if not self.extra:
            return F.cross_entropy(logits, labels.reshape(-1), ignore_index=-100)
        logp = F.log_softmax(logits, dim=-1)  # read again below: all rows are needed
        entropy = -(logp.exp() * logp).sum(-1).mean()
        return F.nll_loss(logp, labels.reshape(-1), ignore_index=-100) - 0.1 * entropy


def _masked_lm(extra: bool, bits: int | None, softmax_dim: int = -1) -> tuple[int, torch.Tensor]:
    """The model's bytes (``<model>``'s record, the log-probabilities) and its gradient."""
    torch.manual_seed(0)
    model = _MaskedLM(extra, softmax_dim)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 512, (16, 32), generator=g)
    labels = torch.where(torch.rand(16, 32, generator=g) < 0.15, tokens, torch.full_like(tokens, -100))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ctl = None
    if bits is not None:
        ctl = memctl.Controller(model, opt, bits=float(bits), log_prob_bits=8, monitor_interval_s=0,
                                calibration_fraction=0)
    model(tokens, labels).backward()
    opt.step()
    packed = 0
    if ctl is not None:
        packed = next(e["packed_bytes"] for e in ctl.stats()["layers"] if e["name"] == "<model>")
        ctl.detach()
    return packed, torch.cat([p.grad.flatten() for p in model.parameters()]).double()


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()))


def test_rows_the_loss_ignores_are_not_stored() -> None:
    full_rows = 16 * 32 * 512  # one byte per value at 8 bits
    packed, grad = _masked_lm(False, 8)
    plain = _masked_lm(False, None)[1]
    assert packed < 0.25 * full_rows  # about 15% of the rows
    assert _cos(grad, plain) > 0.9999


def test_rows_are_all_kept_when_another_op_reads_the_log_probabilities() -> None:
    packed, grad = _masked_lm(True, 8)
    plain = _masked_lm(True, None)[1]
    assert packed > 16 * 32 * 512  # every row, at 8 bits, and its group floors
    assert _cos(grad, plain) > 0.9999


def test_rows_are_all_kept_when_the_softmax_runs_across_rows() -> None:
    """log_softmax over dim 0: an ignored row's gradient is ``−exp(y)·Σg`` of its column, not 0."""
    packed, grad = _masked_lm(False, 8, softmax_dim=0)
    plain = _masked_lm(False, None, softmax_dim=0)[1]
    assert packed > 16 * 32 * 512
    assert _cos(grad, plain) > 0.9999
