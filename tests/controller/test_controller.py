"""Attaching the controller: hooks, attribution, what is compressed, gradients, state."""

from __future__ import annotations

import copy
import threading
from typing import Any

import pytest
import torch
from torch import nn

import memctl
from memctl.controller.hooks import ROOT
from memctl.controller.versions import SavedRef
from tests.controller.models import CNN, MLP, LSTMModel, TransformerBlock, batch_for, loss_for

MODELS = [MLP, CNN, TransformerBlock, LSTMModel]


def _controller(model: nn.Module, **kw: object) -> tuple[memctl.Controller, torch.optim.Optimizer]:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    kw.setdefault("monitor_interval_s", 0)
    kw.setdefault("min_numel", 64)
    return memctl.Controller(model, opt, **kw), opt  # type: ignore[arg-type]


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int = 0) -> float:
    x, y = batch_for(model, seed=seed)
    loss = loss_for(model, model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


@pytest.mark.parametrize("model_cls", MODELS, ids=lambda c: c.__name__)
def test_compresses_every_model_kind(model_cls: type[nn.Module]) -> None:
    torch.manual_seed(0)
    model = model_cls()
    ctl, opt = _controller(model)
    for i in range(3):
        _train_step(model, opt, seed=i)
    s = ctl.stats()
    for key in ("step", "raw_bytes", "packed_bytes", "ratio", "avg_bits", "fallbacks", "budget",
                "batch_size", "layers"):
        assert key in s
    assert s["step"] == 3
    assert s["fallbacks"] == 0
    assert s["attribution"] == "modules"
    assert s["raw_bytes"] > 0
    assert s["ratio"] > 4.0, s
    names = {entry["name"] for entry in s["layers"]}
    assert names, s["layers"]
    for entry in s["layers"]:
        assert set(entry) >= {"name", "bits", "raw_bytes", "packed_bytes", "sensitivity"}
    assert sum(e["raw_bytes"] for e in s["layers"]) == s["raw_bytes"]
    assert sum(e["packed_bytes"] for e in s["layers"]) == s["packed_bytes"]
    ctl.detach()


def test_attribution_innermost_module_and_root() -> None:
    model = CNN()
    ctl, opt = _controller(model)
    _train_step(model, opt)
    names = {e["name"] for e in ctl.stats()["layers"]}
    # a BatchNorm inside a residual block saved its input; so did the conv after the pool
    # (a conv whose input a ReLU saved first shares that record: de-duplication)
    assert {"block1.bn1", "block2.bn2", "block2.conv1"} <= names
    assert ROOT in names  # the loss's log-probabilities, saved outside the model
    root = next(e for e in ctl.stats()["layers"] if e["name"] == ROOT)
    # stored as probabilities at 8 bits (NOTE [ Log-probabilities ])
    assert root["packed_bytes"] < root["raw_bytes"]
    ctl.detach()
    ctl, opt = _controller(model, log_prob_bits=None)
    _train_step(model, opt)
    root = next(e for e in ctl.stats()["layers"] if e["name"] == ROOT)
    assert root["packed_bytes"] == root["raw_bytes"]  # kept exact (NOTE [ What is compressed ])
    ctl.detach()


def test_parameters_are_not_compressed_and_saved_as_is() -> None:
    model = MLP()
    ctl, opt = _controller(model)
    seen: list[object] = []
    original_pack = ctl._packer.pack

    def spy(t: torch.Tensor) -> object:
        out = original_pack(t)
        seen.append((t, out))
        return out

    ctl._scope._pack = spy
    _train_step(model, opt)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    param_saves = [(t, out) for t, out in seen if t.untyped_storage().data_ptr() in params]
    assert param_saves, "a Linear saves its weight"
    # saved as they are, with their version for the in-place check (NOTE [ In-place checks ])
    assert all(isinstance(out, SavedRef) and out.tensor is t for t, out in param_saves)
    ctl.detach()


def test_non_float_lossless_small_passthrough_and_dedup() -> None:
    model = CNN()
    ctl, opt = _controller(model, min_numel=10**9)  # nothing large enough to compress
    _train_step(model, opt)
    s = ctl.stats()
    assert s["packed_bytes"] == s["raw_bytes"]  # every float passed through
    assert s["other_bytes"] > 0  # max-pool indices and targets, held as they are (below min_numel)
    ctl.detach()

    model = CNN()
    ctl, opt = _controller(model)
    x, y = batch_for(model)
    loss_for(model, model(x), y).backward()
    dedup_packs = ctl._packer.packs
    opt.step()
    opt.zero_grad()
    ctl.detach()

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    params |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    plain_saves = 0

    def count(t: torch.Tensor) -> torch.Tensor:
        nonlocal plain_saves
        plain_saves += t.untyped_storage().data_ptr() not in params
        return t

    with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
        loss_for(model, model(x), y).backward()
    # relu(inplace) outputs are saved by relu and again by max_pool / the residual add
    assert 0 < dedup_packs < plain_saves


def test_eight_bits_gradients_match() -> None:
    for model_cls in MODELS:
        torch.manual_seed(0)
        ref = model_cls()
        model = model_cls()
        model.load_state_dict(ref.state_dict())
        ref.eval() if model_cls is CNN else None
        model.eval() if model_cls is CNN else None
        x, y = batch_for(ref, n=16)
        loss_for(ref, ref(x), y).backward()
        ctl, _ = _controller(model, bits=8)
        loss_for(model, model(x), y).backward()
        for (name, p_ref), p in zip(ref.named_parameters(), model.parameters(), strict=True):
            if p_ref.grad is None or p_ref.grad.abs().sum() == 0:
                continue
            cos = nn.functional.cosine_similarity(p_ref.grad.flatten(), p.grad.flatten(), dim=0)
            assert cos > 0.999, (model_cls.__name__, name, float(cos))
        ctl.detach()


def test_two_bits_training_converges() -> None:
    torch.manual_seed(0)
    model = MLP()
    ctl, opt = _controller(model, bits=2)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 64, generator=g)
    y = (x @ torch.randn(64, 10, generator=g)).argmax(dim=1)
    losses = []
    for _ in range(200):
        idx = torch.randint(0, 256, (64,), generator=g)
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    # plain PyTorch reaches ~0.004 on this task; 2-bit activations must get close
    assert sum(losses[-10:]) / 10 < 0.05, losses[-10:]
    # bits=2 is an average: the calibrated allocation may trade 1 bit on one layer for 4 on
    # another (which it does depends on the probes' measured draws), never more on average
    assert 1.0 <= ctl.stats()["avg_bits"] <= 2.0 + 0.01
    # the head's input, one of the MLP's three compressed tensors, at 4 bits (NOTE [ The head's input ])
    assert ctl.stats()["ratio"] > 7
    ctl.detach()


def test_detach_and_context_manager_restore_plain_pytorch() -> None:
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with memctl.Controller(model, opt, monitor_interval_s=0, min_numel=64) as ctl:
        _train_step(model, opt)
        assert ctl.stats()["step"] == 1
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None
    _train_step(model, opt)  # plain PyTorch again: the controller no longer counts steps
    assert ctl.stats()["step"] == 1


def test_two_controllers_do_not_interfere() -> None:
    a, b = MLP(), CNN()
    ca, oa = _controller(a)
    cb, ob = _controller(b)
    xa, ya = batch_for(a)
    xb, yb = batch_for(b)
    # interleaved forwards: each window closes without popping the other's hooks
    la = loss_for(a, a(xa), ya)
    lb = loss_for(b, b(xb), yb)
    la.backward()
    oa.step()
    oa.zero_grad()
    lb.backward()
    ob.step()
    ob.zero_grad()
    sa, sb = ca.stats(), cb.stats()
    # (the first layers save only the model's inputs, kept by reference: NOTE [ Model inputs ])
    assert "act" in {e["name"] for e in sa["layers"]}
    assert not {e["name"] for e in sa["layers"]} & {"bn", "block1.bn1"}
    assert {e["name"] for e in sb["layers"]} >= {"bn", "block1.bn1"}
    assert sa["step"] == sb["step"] == 1
    ca.detach()
    cb.detach()
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None


def test_each_of_two_models_trained_in_turn_reaches_its_own_controller() -> None:
    """NOTE [ Two controllers ]: a GAN's two models, each with its own controller and
    optimizer, whose windows overlap; the discriminator's forward in the generator's step
    and its next forward (its window open below the generator's) go to its own controller."""
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 256), nn.Tanh())
    disc = nn.Sequential(nn.Linear(256, 256), nn.LeakyReLU(0.2), nn.Linear(256, 1))
    cg, og = _controller(gen, bits=2)
    cd, od = _controller(disc, bits=2)
    seen: dict[str, list[str]] = {"gen": [], "disc": []}
    for name, ctl in (("gen", cg), ("disc", cd)):
        pack = ctl._packer.pack

        def spy(t: torch.Tensor, pack: Any = pack, name: str = name, tracker: Any = ctl._tracker) -> Any:
            seen[name].append(tracker.current)
            return pack(t)

        ctl._scope._inner_pack = spy
    bce = nn.functional.binary_cross_entropy_with_logits
    for _ in range(3):
        for k in seen:
            seen[k].clear()
        fake = gen(torch.randn(64, 16))
        real = torch.randn(64, 256)
        loss_d = bce(disc(real), torch.ones(64, 1)) + bce(disc(fake.detach()), torch.zeros(64, 1))
        od.zero_grad()
        loss_d.backward()
        od.step()
        loss_g = bce(disc(fake), torch.ones(64, 1))
        og.zero_grad()
        loss_g.backward()
        og.step()
    # the generator's controller saw its own forward and no discriminator layer
    assert seen["gen"] and set(seen["gen"]) <= {"0", "1", "2", "3", ROOT}
    assert {"0", "1", "2"} <= set(seen["disc"])
    sg, sd = cg.stats(), cd.stats()
    assert sg["step"] == sd["step"] == 3
    assert sg["ratio"] > 4 and sd["ratio"] > 4
    cg.detach()
    cd.detach()
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None


def test_a_users_hooks_around_a_forward_stay_on_top() -> None:
    """A ``saved_tensors_hooks`` context the user opens around a forward, with the model's
    window open below it, still gets the tensors and pops its own pair."""
    model = MLP()
    ctl, opt = _controller(model)
    x, y = batch_for(model)
    loss_for(model, model(x), y).backward()  # the window opens and stays open until the step
    got: list[torch.Tensor] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        got.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        loss = loss_for(model, model(x), y)
    assert got
    loss.backward()
    opt.step()
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None
    ctl.detach()


def test_a_step_after_the_optimizers_is_ignored_with_one_warning() -> None:
    """NOTE [ One boundary per step ]: ``ctl.step()`` after ``optimizer.step()`` of a
    controller made with that optimizer made a second, empty boundary (``raw_bytes`` 0)."""
    model = MLP()
    ctl, opt = _controller(model)
    with pytest.warns(RuntimeWarning, match="already advanced") as caught:
        for seed in range(3):
            _train_step(model, opt, seed)
            ctl.step()
            ctl.step()
    assert len([w for w in caught if "already advanced" in str(w.message)]) == 1
    stats = ctl.stats()
    assert stats["step"] == 3
    assert stats["raw_bytes"] > 0 and stats["ratio"] > 2
    ctl.detach()


def test_a_controller_without_an_optimizer_steps_at_each_call() -> None:
    model = MLP()
    ctl = memctl.Controller(model, monitor_interval_s=0, min_numel=64)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for seed in range(3):
        _train_step(model, opt, seed)
        ctl.step()
    assert ctl.stats()["step"] == 3 and ctl.stats()["raw_bytes"] > 0
    ctl.step()  # no forward since: a step all the same, as asked
    assert ctl.stats()["step"] == 4
    ctl.detach()


def _eight_bit_cosine(model: nn.Module, forward: Any, leave_out: str | None = None,
                      ) -> tuple[float, memctl.Controller, torch.optim.Optimizer]:
    """The cosine of the gradient (the parameters', but those named from ``leave_out``, and
    then the input's too) with a controller at 8 bits against a plain copy's; the controller
    and its optimizer, stepped once."""
    plain = copy.deepcopy(model)
    ctl, opt = _controller(model, bits=8, min_numel=4096)
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
    grads = []
    for net in (model, plain):
        net.zero_grad()
        xg = x.clone().requires_grad_(leave_out is not None)  # (an input with a gradient is no model input)
        nn.functional.cross_entropy(forward(net, xg), y).backward()
        grads.append(torch.cat([*([] if xg.grad is None else [xg.grad.flatten()]),
                                *(p.grad.flatten() for n, p in net.named_parameters()
                                  if leave_out is None or not n.startswith(leave_out))]))
    opt.step()
    return float(nn.functional.cosine_similarity(grads[0], grads[1], dim=0)), ctl, opt


def test_a_container_whose_parts_are_called_is_compressed() -> None:
    """NOTE [ Forwards that enter below the model ]: a ``ModuleDict`` of an encoder and a
    decoder, called part by part, has no forward of its own; memctl compressed nothing."""
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.Tanh())
    dec = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10))
    parts = nn.ModuleDict({"enc": enc, "dec": dec})
    cosine, ctl, opt = _eight_bit_cosine(parts, lambda m, x: m["dec"](m["enc"](x)))
    assert cosine > 0.9999
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
    for _ in range(3):
        opt.zero_grad()
        nn.functional.cross_entropy(parts["dec"](parts["enc"](x)), y).backward()
        opt.step()
    stats = ctl.stats()
    assert stats["step"] == 4
    assert stats["ratio"] > 3  # 8 bits
    names = {e["name"] for e in stats["layers"]}
    assert {"enc.1", "enc.3", "dec.1"} <= names
    assert "enc.0" not in names  # the encoder's input, held as a model input is
    assert [e["kind"] for e in stats["events"]].count("entry") == 1
    ctl.detach()
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None


class _Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 256)
        self.b = nn.Sequential(nn.Linear(256, 256), nn.GELU())
        self.c = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(self.b, torch.relu(self.a(x)), use_reentrant=False)
        return self.c(h)


def test_a_models_own_forward_is_no_entry_below_it() -> None:
    """Nor is a checkpointed region's recomputation in the backward (``b`` runs again there,
    outside the model's forward)."""
    model = _Checkpointed()
    ctl, opt = _controller(model)
    for _ in range(2):
        nn.functional.cross_entropy(model(torch.randn(64, 64)), torch.randint(0, 10, (64,))).backward()
        opt.step()
        opt.zero_grad()
    assert "entry" not in [e["kind"] for e in ctl.stats()["events"]]
    ctl.detach()


class _Wrapper(torch.optim.Optimizer):
    """An optimizer wrapper as accelerate's: an Optimizer that skips ``Optimizer.__init__`` (no
    step hooks) and steps the optimizer it wraps every ``every`` calls."""

    def __init__(self, optimizer: torch.optim.Optimizer, every: int = 1) -> None:
        self.optimizer = optimizer
        self.every = every
        self.calls = 0

    @property
    def param_groups(self) -> Any:  # type: ignore[override]
        return self.optimizer.param_groups

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.calls += 1
        if self.calls % self.every == 0:
            self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.calls % self.every == 0:
            self.optimizer.zero_grad()


def test_a_wrapped_optimizer_steps_the_controller_once_per_real_step() -> None:
    """NOTE [ Wrapped optimizers ]: registering a step hook on the wrapper raised inside
    ``Controller(...)``; the wrapped optimizer is hooked, and steps once per two micro-batches."""
    model = MLP()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapper = _Wrapper(inner, every=2)
    ctl = memctl.Controller(model, wrapper, monitor_interval_s=0, min_numel=64)
    assert ctl.optimizer is inner
    for seed in range(6):
        x, y = batch_for(model, seed=seed)
        loss_for(model, model(x), y).backward()
        wrapper.step()
        wrapper.zero_grad()
    stats = ctl.stats()
    assert stats["step"] == 3 and stats["micro_batches"] == 2
    assert stats["raw_bytes"] > 0
    # accumulation keeps the gradients: no step skipped (NOTE [ Skipped optimizer steps ])
    assert "skipped_step" not in [e["kind"] for e in stats["events"]]
    ctl.detach()


def test_a_wrapper_with_nothing_to_hook_is_a_clear_error() -> None:
    model = MLP()
    bare = _Wrapper(torch.optim.SGD(model.parameters(), lr=0.1))
    bare.optimizer = None  # type: ignore[assignment]
    with pytest.raises(memctl.ConfigError, match=r"no step hooks.*optimizer=None"):
        memctl.Controller(model, bare, monitor_interval_s=0)


def test_accelerates_optimizer_is_unwrapped() -> None:
    accelerate = pytest.importorskip("accelerate")
    model = MLP()
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ctl = memctl.Controller(model, opt, monitor_interval_s=0, min_numel=64)
    for seed in range(4):
        with acc.accumulate(model):
            x, y = batch_for(model, seed=seed)
            acc.backward(loss_for(model, model(x), y))
            opt.step()
            opt.zero_grad()
    assert ctl.stats()["step"] == 2 and ctl.stats()["micro_batches"] == 2
    ctl.detach()
    # accelerate keeps its state in process-wide singletons: leave none for the Trainer's tests
    accelerate.state.AcceleratorState._reset_state(True)
    accelerate.state.GradientState._reset_state()


class _ScriptedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(256, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


def test_a_scripted_submodule_is_left_unhooked_and_its_tensors_are_compressed() -> None:
    """NOTE [ TorchScript submodules ]: registering a hook on a ScriptModule raised inside
    ``Controller(...)``."""
    torch.manual_seed(0)
    block = torch.jit.script(_ScriptedBlock())
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), block, nn.Linear(256, 10))
    # (a scripted module's parameters, read through its parent, are not always leaves: the
    # input's gradient, which passes through the block, stands in for them)
    cosine, ctl, _ = _eight_bit_cosine(model, lambda m, x: m(x), leave_out="2.")
    assert cosine > 0.9999
    stats = ctl.stats()
    assert stats["raw_bytes"] > 0 and stats["ratio"] > 3
    assert not any(e["name"].startswith("2.") for e in stats["layers"])  # nothing inside is hooked
    ctl.detach()


def test_a_scripted_model_is_a_clear_error() -> None:
    with pytest.raises(memctl.ConfigError, match="TorchScript"):
        memctl.Controller(torch.jit.script(_ScriptedBlock()), monitor_interval_s=0)


def test_a_step_skipped_by_a_gradient_scaler_is_a_step() -> None:
    """NOTE [ Skipped optimizer steps ]: fp16 with a scale large enough to overflow skips the
    optimizer's step; the forwards after such steps were counted as micro-batches of one."""
    model = MLP()
    ctl, opt = _controller(model, bits=2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    x, y = batch_for(model)
    for _ in range(6):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_for(model, model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert scaler.get_scale() < 2.0**40  # steps were skipped
    stats = ctl.stats()
    assert stats["micro_batches"] == 1 and stats["step"] >= 5
    assert [e["kind"] for e in stats["events"]].count("skipped_step") == 1
    ctl.detach()


def test_codec_failure_falls_back_and_training_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    model = MLP()
    ctl, opt = _controller(model)
    codec = ctl._packer._codec("quantize")

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("injected codec failure")

    monkeypatch.setattr(codec, "encode", broken)
    monkeypatch.setattr(codec, "encode_with_positive", broken)  # ReLU outputs' entry point
    monkeypatch.setattr(codec, "encode_into", broken)  # small records' (NOTE [ Batched small records ])
    loss = _train_step(model, opt)
    assert loss == loss  # finite, training went on
    s = ctl.stats()
    assert s["fallbacks"] > 0
    assert s["packed_bytes"] == s["raw_bytes"]
    assert any(e["kind"] == "codec_fallback" for e in s["events"])
    ctl.detach()


def test_state_dict_round_trip() -> None:
    model = CNN()
    ctl, opt = _controller(model, budget="64MiB", allocation_interval=2)
    for i in range(3):
        _train_step(model, opt, seed=i)
    sd = ctl.state_dict()
    ctl.detach()
    model2 = CNN()
    ctl2, _ = _controller(model2)
    ctl2.load_state_dict(sd)
    assert ctl2.state_dict() == sd
    assert ctl2.stats()["step"] == 3
    assert ctl2.budget is not None and ctl2.budget.nbytes == 64 * 2**20
    assert {n: s.bits for n, s in ctl2._layers.items()} == {n: s.bits for n, s in ctl._layers.items()}
    with pytest.raises(memctl.ConfigError, match="version"):
        ctl2.load_state_dict({**sd, "version": 99})
    ctl2.detach()


def test_a_compiled_graphs_tensors_are_held_and_reported() -> None:
    """NOTE [ Graphs compiled by torch.compile ]: memctl sees no op inside a compiled graph, so
    what it saves is held as it is (the same gradients as plain), and that is said once."""
    torch.manual_seed(0)
    model = MLP()
    plain = copy.deepcopy(model)
    ctl, opt = _controller(model)
    compiled = torch.compile(model, backend="aot_eager")
    x, y = batch_for(model, n=32)
    with pytest.warns(RuntimeWarning, match="torch.compile"):
        for _ in range(2):
            loss = nn.functional.cross_entropy(compiled(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.5)
    compiled_plain = torch.compile(plain, backend="aot_eager")
    for _ in range(2):
        nn.functional.cross_entropy(compiled_plain(x), y).backward()
        plain_opt.step()
        plain_opt.zero_grad()
    s = ctl.stats()
    assert ctl._packer.compiled_passed > 0 and s["packed_bytes"] == s["raw_bytes"]
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q)
    ctl.detach()


def test_bad_arguments_name_the_value() -> None:
    model = MLP()
    with pytest.raises(memctl.ConfigError, match="bits=3"):
        memctl.Controller(model, bits=3, bit_choices=(1, 2), monitor_interval_s=0)
    with pytest.raises(memctl.ConfigError, match="nonsense"):
        memctl.Controller(model, nonsense=1)
    with pytest.raises(memctl.ConfigError, match=r"solver='simplex'.*'auto'"):
        memctl.Controller(model, solver="simplex", monitor_interval_s=0)
    with pytest.raises(memctl.BudgetError, match="12XB"):
        memctl.Controller(model, budget="12XB")
    with pytest.raises(memctl.ConfigError, match="Module"):
        memctl.Controller("model")  # type: ignore[arg-type]


def test_set_budget_from_another_thread_applies_at_next_step() -> None:
    model = MLP()
    ctl, opt = _controller(model)
    _train_step(model, opt)
    t = threading.Thread(target=ctl.set_budget, args=("256MiB",))
    t.start()
    t.join()
    assert ctl.stats()["budget"] is None
    assert ctl.budget_info()["pending"] == 256 * 2**20
    _train_step(model, opt)
    assert ctl.stats()["budget"] == 256 * 2**20
    assert ctl.budget_info()["pending"] is None
    ctl.detach()


def test_errorbound_mode_and_acgc_objective() -> None:
    torch.manual_seed(0)
    model = CNN()
    ctl, opt = _controller(model, codec="errorbound", objective="bytes", allocation_interval=1)
    losses = [_train_step(model, opt, seed=i) for i in range(4)]
    s = ctl.stats()
    assert all(loss == loss for loss in losses)
    assert s["codec"] == "errorbound"
    assert s["fallbacks"] == 0
    bounded = [e for e in s["layers"] if e["error_bound"] is not None]
    assert bounded and all(e["error_bound"] > 0 for e in bounded)
    assert s["packed_bytes"] < s["raw_bytes"]
    assert s["allocation"]["feasible"]
    ctl.detach()


def test_monitor_runs_with_the_controller() -> None:
    model = MLP()
    ctl, opt = _controller(model, monitor_interval_s=0.02)
    assert ctl._monitor is not None
    _train_step(model, opt)
    mem = ctl.stats()["memory"]
    assert mem is not None and mem["reader"] == "host" and mem["process_bytes"] > 0
    assert ctl.history()
    monitor = ctl._monitor
    ctl.detach()
    assert ctl._monitor is None and not monitor.running


def test_a_small_integer_tensor_is_held_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loss's targets (below ``min_numel``): the tensor itself, no lossless encode, version-checked."""
    model = MLP()
    ctl, _ = _controller(model)
    x, y = batch_for(model)
    encodes = [0]
    codec = ctl._packer._codec("lossless")
    inner = codec.encode

    def counted(*args: Any, **kwargs: Any) -> Any:
        encodes[0] += 1
        return inner(*args, **kwargs)

    monkeypatch.setattr(codec, "encode", counted)
    loss = loss_for(model, model(x), y)
    y.add_(0)  # bumps the version: autograd's in-place check fires, as without memctl
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    assert encodes[0] == 0
    ctl.detach()
