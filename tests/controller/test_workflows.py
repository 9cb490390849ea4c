"""Training workflows that must keep working with a controller attached (issue 9, items 1-4).

Each test says which workflow it covers: copies and saves of an attached model, gradient
accumulation, autograd's in-place checks, and the capture window of the saved-tensor hooks.
The step boundary (item 5) and faults are in ``test_faults.py``; monitor shutdown (item 6)
in ``tests/monitor/test_shutdown.py``.
"""

from __future__ import annotations

import contextlib
import copy
import io
import pickle
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

import memctl
from memctl.controller.config import KEEP_BITS
from memctl.controller.copysafe import ControllerHook
from memctl.controller.packing import Saved
from memctl.errors import ConfigError
from tests.controller.models import CNN, MLP, batch_for, loss_for

INPLACE = "one of the variables needed for gradient computation has been modified by an inplace operation"


def _controller(model: nn.Module, **kw: Any) -> tuple[memctl.Controller, torch.optim.Optimizer]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kw.setdefault("monitor_interval_s", 0)
    kw.setdefault("min_numel", 64)
    return memctl.Controller(model, opt, **kw), opt


def _step(model: nn.Module, opt: torch.optim.Optimizer, n: int = 16, micro: int = 1, seed: int = 0) -> None:
    for i in range(micro):
        x, y = batch_for(model, n=n, seed=seed * 100 + i)
        (loss_for(model, model(x), y) / micro).backward()
    opt.step()
    opt.zero_grad()


def _hook_stack_top() -> object:
    return torch._C._autograd._top_saved_tensors_default_hooks(True)


def _memctl_hooks(model: nn.Module) -> int:
    return sum(
        isinstance(h, ControllerHook)
        for m in model.modules()
        for d in (m._forward_pre_hooks, m._forward_hooks)
        for h in d.values()
    )


def _all_hooks(model: nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


# -- 1. copies and saves of an attached model ------------------------------------------

def test_deepcopy_of_attached_model_is_plain_pytorch() -> None:
    torch.manual_seed(0)
    model = CNN()
    ctl, opt = _controller(model)
    _step(model, opt)
    clone = copy.deepcopy(model)  # TypeError: cannot pickle '_thread.lock' object before
    assert _memctl_hooks(clone) == 0
    packs = ctl._packer.packs
    x, y = batch_for(clone, n=4)
    loss_for(clone, clone(x), y).backward()
    assert ctl._packer.packs == packs, "the copy's forward reached the controller"
    assert _all_hooks(clone) == 0, "placeholders left the copy's hook dictionaries"
    # the copy's gradients are plain PyTorch's
    plain = copy.deepcopy(clone)
    plain.zero_grad()
    clone.zero_grad()
    torch.manual_seed(1)  # the same dropout mask for both
    loss_for(plain, plain(x), y).backward()
    torch.manual_seed(1)
    loss_for(clone, clone(x), y).backward()
    for a, b in zip(_grads(plain), _grads(clone), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # the original is still managed
    _step(model, opt, seed=1)
    assert ctl._packer.packs > packs
    assert ctl.stats()["step"] == 2
    ctl.detach()


def test_averaged_model_ema_of_attached_model() -> None:
    torch.manual_seed(0)
    model = MLP()
    ctl, opt = _controller(model)
    ema = torch.optim.swa_utils.AveragedModel(
        model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9)
    )
    for i in range(3):
        _step(model, opt, seed=i)
        ema.update_parameters(model)
    x, _ = batch_for(model, n=4)
    with torch.no_grad():
        out = ema(x)
    assert out.shape == (4, 10) and torch.isfinite(out).all()
    assert ctl.stats()["step"] == 3
    assert ctl.stats()["micro_batches"] == 1
    assert _memctl_hooks(ema) == 0
    ctl.detach()


def test_pickle_and_torch_save_of_attached_model() -> None:
    torch.manual_seed(0)
    model = MLP()
    ctl, opt = _controller(model)
    _step(model, opt)
    x, _ = batch_for(model, n=4)
    with torch.no_grad():
        expected = model(x)
    restored = pickle.loads(pickle.dumps(model))
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for copy_ in (restored, loaded):
        assert _memctl_hooks(copy_) == 0
        with torch.no_grad():
            torch.testing.assert_close(copy_(x), expected)
        assert _all_hooks(copy_) == 0
    ctl.detach()


def test_a_copy_can_get_its_own_controller() -> None:
    model = MLP()
    ctl, opt = _controller(model)
    clone = copy.deepcopy(model)
    ctl2, opt2 = _controller(clone)
    _step(clone, opt2)
    _step(model, opt)
    assert ctl.stats()["step"] == 1 and ctl2.stats()["step"] == 1
    assert ctl.stats()["raw_bytes"] == ctl2.stats()["raw_bytes"] > 0
    ctl.detach()
    ctl2.detach()


# -- 2. gradient accumulation --------------------------------------------------------

def _spy_on_saved(ctl: memctl.Controller) -> list[tuple[weakref.ref[Saved], int]]:
    """Weak references to every record the pack hook returns, with its raw bytes."""
    found: list[tuple[weakref.ref[Saved], int]] = []
    inner = ctl._scope._inner_pack

    def spy(t: torch.Tensor) -> object:
        out = inner(t)
        if isinstance(out, Saved):
            found.append((weakref.ref(out), t.numel() * t.element_size()))
        return out

    ctl._scope._inner_pack = spy
    return found


def test_accumulation_frees_each_micro_batch_when_its_backward_ends() -> None:
    torch.manual_seed(0)
    model = MLP()
    ctl, opt = _controller(model)
    saved = _spy_on_saved(ctl)
    for i in range(4):
        x, y = batch_for(model, n=16, seed=i)
        loss_for(model, model(x), y).backward()
        assert saved, "the forward saved nothing"
        alive = [r for r, _ in saved if r() is not None]
        assert not alive, f"micro-batch {i}: {len(alive)} records held after its backward"
        saved.clear()
    opt.step()
    opt.zero_grad()
    ctl.detach()


def test_accumulation_counts_live_bytes_per_micro_batch() -> None:
    torch.manual_seed(0)
    model_a, model_b = MLP(), MLP()
    # calibration off: how many layers a probe measures depends on the clock, so two
    # calibrated controllers can allocate differently on a loaded machine
    ctl_a, opt_a = _controller(model_a, calibration_fraction=0)
    ctl_b, opt_b = _controller(model_b, calibration_fraction=0)
    for i in range(2):
        _step(model_a, opt_a, n=16, micro=4, seed=i)  # 4 x 16 per optimizer step
        _step(model_b, opt_b, n=16, micro=1, seed=i)  # 1 x 16
    a, b = ctl_a.stats(), ctl_b.stats()
    assert a["micro_batches"] == 4 and b["micro_batches"] == 1
    assert a["raw_bytes"] == b["raw_bytes"] > 0  # what one micro-batch holds, not 4x it
    assert a["packed_bytes"] == b["packed_bytes"]
    assert ctl_a.batch_size == ctl_b.batch_size == 16  # samples per forward
    ctl_a.detach()
    ctl_b.detach()


def test_two_forwards_before_one_backward_count_together() -> None:
    torch.manual_seed(0)
    model = MLP()
    ctl, opt = _controller(model)
    _step(model, opt, n=16)
    single = ctl.stats()["raw_bytes"]
    x1, y1 = batch_for(model, n=16, seed=1)
    x2, y2 = batch_for(model, n=16, seed=2)
    (loss_for(model, model(x1), y1) + loss_for(model, model(x2), y2)).backward()
    opt.step()
    opt.zero_grad()
    s = ctl.stats()
    assert s["micro_batches"] == 2
    assert s["raw_bytes"] > 1.5 * single  # both graphs were alive at once
    ctl.detach()


def _track_live_bytes(ctl: memctl.Controller) -> dict[str, int]:
    """Raw bytes of the records autograd still holds, and their peak (from weak references)."""
    live = {"now": 0, "peak": 0}
    seen: set[int] = set()
    inner = ctl._scope._inner_pack

    def release(key: int, nbytes: int) -> None:
        seen.discard(key)
        live["now"] -= nbytes

    def spy(t: torch.Tensor) -> object:
        out = inner(t)
        if isinstance(out, Saved) and id(out) not in seen:
            nbytes = t.numel() * t.element_size()
            seen.add(id(out))
            weakref.finalize(out, release, id(out), nbytes)
            live["now"] += nbytes
            live["peak"] = max(live["peak"], live["now"])
        return out

    ctl._scope._inner_pack = spy
    return live


def test_oom_split_drops_the_memory_held() -> None:
    torch.manual_seed(0)
    model = MLP(d_hidden=256)
    ctl, _ = _controller(model)
    live = _track_live_bytes(ctl)
    peaks: list[int] = []

    def compute_loss(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        loss = loss_for(model, model(x), y)
        if x.shape[0] > 16:
            peaks.append(live["peak"])
            live["peak"] = 0
            raise torch.OutOfMemoryError("simulated: CUDA out of memory")
        return loss

    ctl.guarded_step(compute_loss, batch_for(model, n=64))
    assert ctl.batch_size == 16
    full = peaks[0]  # the whole batch's forward, before it ran out of memory
    assert live["peak"] <= 0.4 * full, (live["peak"], full)  # a quarter of it, not 91%
    ctl.detach()


# -- 3. in-place checks -----------------------------------------------------------------

def _inplace_error(fn: Any) -> str:
    with pytest.raises(RuntimeError, match=INPLACE) as info:
        fn()
    return str(info.value)


def _weight_changed(attached: bool) -> str:
    torch.manual_seed(0)
    model = MLP()
    ctl = _controller(model)[0] if attached else None
    try:
        x, y = batch_for(model, n=4)
        loss = loss_for(model, model(x), y)
        with torch.no_grad():
            model.fc3.weight.mul_(2.0)
        return _inplace_error(loss.backward)
    finally:
        if ctl is not None:
            ctl.detach()


def test_weight_changed_between_forward_and_backward_raises_like_plain_pytorch() -> None:
    plain = _weight_changed(attached=False)
    # The tensor's description is in every PyTorch's wording; the rest (torch 2.13 adds "which
    # is output 0 of AsStrided,") varies between releases, and memctl's must equal it as it is.
    assert "[torch.FloatTensor [128, 10]]" in plain
    assert _weight_changed(attached=True) == plain


def _backward_across_step(attached: bool) -> str:
    torch.manual_seed(0)
    model = MLP()
    ctl, opt = _controller(model) if attached else (None, torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        x, y = batch_for(model, n=4)
        loss = loss_for(model, model(x), y)
        loss.backward(retain_graph=True)
        opt.step()
        return _inplace_error(loss.backward)
    finally:
        if ctl is not None:
            ctl.detach()


def test_backward_twice_across_an_optimizer_step_raises_like_plain_pytorch() -> None:
    assert _backward_across_step(attached=True) == _backward_across_step(attached=False)


@contextlib.contextmanager
def _maybe_attached(model: nn.Module, attached: bool, keep: bool = False) -> Iterator[None]:
    """A controller on ``model`` for the block when ``attached`` (detached after it), else none;
    ``keep``: every layer at "keep" (KEEP_BITS, uncompressed)."""
    ctl = _controller(model)[0] if attached else None
    if ctl is not None and keep:
        ctl._packer._choice_for = lambda layer: (KEEP_BITS, None)
    try:
        yield
    finally:
        if ctl is not None:
            ctl.detach()


def _activation_modified(attached: bool) -> str:
    torch.manual_seed(0)
    model = MLP()
    with _maybe_attached(model, attached):
        x, _ = batch_for(model, n=32)
        e = model(x).exp()  # exp saves its output
        loss = e.sum()
        with torch.no_grad():
            e.mul_(2.0)
        return _inplace_error(loss.backward)


def test_activation_modified_in_place_raises_like_plain_pytorch() -> None:
    plain = _activation_modified(attached=False)
    assert "[torch.FloatTensor [32, 10]]" in plain
    assert _activation_modified(attached=True) == plain


class _SmallSave(nn.Module):
    """Saves a small tensor (exp saves its output) inside the forward and returns a view of it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).exp().view(-1)


def _small_modified(attached: bool, through_a_view: bool) -> str:
    torch.manual_seed(0)
    model = _SmallSave()
    with _maybe_attached(model, attached):  # min_numel 64: the 8 values are kept as they are
        out = model(torch.randn(2, 4))
        loss = out.sum()
        if through_a_view:
            view = out[2:]  # the saved tensor's Python object goes; its storage lives in the view
            del out
            with torch.no_grad():
                view.mul_(2.0)
        else:
            with torch.no_grad():
                out.mul_(2.0)
        return _inplace_error(loss.backward)


@pytest.mark.parametrize("through_a_view", [False, True])
def test_a_small_tensor_kept_as_it_is_raises_like_plain_pytorch(through_a_view: bool) -> None:
    """A tensor below ``min_numel`` is held as it is, not copied (NOTE [ What is compressed ]): a
    change in place before the backward raises autograd's error, as without memctl, also when
    only a view of it is left to change it."""
    plain = _small_modified(attached=False, through_a_view=through_a_view)
    assert _small_modified(attached=True, through_a_view=through_a_view) == plain


def test_a_small_tensor_kept_as_it_is_is_not_copied() -> None:
    torch.manual_seed(0)
    model = _SmallSave()
    ctl = _controller(model)[0]
    try:
        out = model(torch.randn(2, 4))
        exp = out.grad_fn.next_functions[0][0]
        assert type(exp).__name__ == "ExpBackward0"
        kept = exp._saved_result  # through memctl's unpack hook
        assert kept.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
        out.sum().backward()
    finally:
        ctl.detach()


class _FirstToken(nn.Module):
    """A classifier on the first token of a norm's output (a ViT's or BERT's head)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x)[:, 0])


@pytest.mark.parametrize("attached", [False, True])
def test_a_small_view_does_not_keep_its_large_tensor(attached: bool) -> None:
    """NOTE [ Small views of large tensors ]: the head saves 32 values of the norm's 16,384
    (below ``min_numel``: held as they are); plain PyTorch keeps the norm's output alive for
    them, memctl a copy of the 32 alone, and the gradients are plain PyTorch's."""
    torch.manual_seed(0)
    model = _FirstToken()
    x = torch.randn(1, 512, 32)
    outputs: list[StorageWeakRef] = []  # the storage: a view keeps it, not the tensor object
    handle = model.norm.register_forward_hook(
        lambda m, a, out: outputs.append(StorageWeakRef(out.untyped_storage())))
    grads = []
    for on in (False, attached):
        model.zero_grad()
        # min_numel 1024: the norm's row statistics (512 values) are held exact as well
        ctl = _controller(model, min_numel=1024)[0] if on else None
        loss = model(x).square().sum()
        alive = not outputs[-1].expired()
        loss.backward()
        if ctl is not None:
            ctl.detach()
        grads.append([p.grad.clone() for p in model.parameters()])
    handle.remove()
    assert alive is not attached  # without memctl the output lives into the backward
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


class _ExpLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 128)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).exp()


def _kept_layer_modified(attached: bool) -> str:
    torch.manual_seed(0)
    model = _ExpLayer()
    with _maybe_attached(model, attached, keep=True):
        out = model(torch.randn(64, 64))
        loss = out.sum()
        with torch.no_grad():
            out.mul_(2.0)
        return _inplace_error(loss.backward)


def test_a_layer_kept_uncompressed_holds_its_tensors_as_they_are() -> None:
    """A layer at "keep" (KEEP_BITS) holds its saved tensors themselves, not copies (no memory
    twice), version-checked: a change in place raises autograd's error as without memctl."""
    torch.manual_seed(0)
    model = _ExpLayer()
    with _maybe_attached(model, True, keep=True):
        out = model(torch.randn(64, 64))
        assert out.grad_fn._saved_result.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
        out.sum().backward()
    assert _kept_layer_modified(attached=True) == _kept_layer_modified(attached=False)


def test_no_false_inplace_errors_with_inplace_relu_and_batchnorm() -> None:
    torch.manual_seed(0)
    model = CNN()
    ctl, opt = _controller(model)
    for i in range(2):
        _step(model, opt, seed=i)
    assert ctl.stats()["step"] == 2
    ctl.detach()


# -- 4. the capture window --------------------------------------------------------------

def test_grad_forward_without_step_does_not_inflate_the_next_step() -> None:
    torch.manual_seed(0)
    model = MLP()
    ctl, opt = _controller(model)
    _step(model, opt, n=64)
    before = ctl.stats()
    for i in range(4):  # validation without no_grad, a larger batch, no backward
        x, _ = batch_for(model, n=256, seed=10 + i)
        model(x)
    _step(model, opt, n=64, seed=1)
    after = ctl.stats()
    assert after["raw_bytes"] == before["raw_bytes"]
    assert after["batch_size"] == before["batch_size"] == 64
    assert after["micro_batches"] == 1
    ctl.detach()


class _Flaky(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = MLP()
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body.act(self.body.fc1(x))
        if self.fail:
            raise ValueError("bad sample")
        return self.body.fc3(self.body.act(self.body.fc2(h)))


def test_forward_that_raises_leaves_no_window_behind() -> None:
    torch.manual_seed(0)
    model = _Flaky()
    ctl, opt = _controller(model)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    before = ctl.stats()
    model.fail = True
    with pytest.raises(ValueError, match="bad sample"):
        model(torch.randn(512, 64))
    model.fail = False
    # an unrelated model's forward in the same thread is not packed, and the hooks leave
    other = MLP()
    packs = ctl._packer.packs
    other(torch.randn(8, 64)).sum().backward()
    assert ctl._packer.packs == packs
    assert _hook_stack_top() is None
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    after = ctl.stats()
    assert after["raw_bytes"] == before["raw_bytes"] and after["batch_size"] == 32
    ctl.detach()


def test_unrelated_model_after_validation_forward_is_not_packed() -> None:
    torch.manual_seed(0)
    model = MLP()
    ctl, opt = _controller(model)
    _step(model, opt)
    x, _ = batch_for(model, n=16)
    model(x)  # grad-enabled, no backward, output dropped
    other = CNN()
    packs = ctl._packer.packs
    ox, oy = batch_for(other, n=4)
    loss_for(other, other(ox), oy).backward()
    assert ctl._packer.packs == packs
    assert _hook_stack_top() is None
    ctl.detach()


def test_detach_from_another_thread_leaves_no_hooks_in_the_training_thread() -> None:
    torch.manual_seed(0)
    model = MLP()
    ctl, opt = _controller(model)
    _step(model, opt)
    x, y = batch_for(model, n=16)
    loss = loss_for(model, model(x), y)  # the window is open in this thread
    t = threading.Thread(target=ctl.detach)
    t.start()
    t.join()
    assert not ctl.attached
    assert _memctl_hooks(model) == 0
    loss.backward()  # what was saved before detach still unpacks
    assert all(p.grad is not None for p in model.parameters())
    packs = ctl._packer.packs
    model.zero_grad()
    loss_for(model, model(x), y).backward()  # plain PyTorch now
    assert ctl._packer.packs == packs
    assert _hook_stack_top() is None


def test_second_controller_on_the_same_model_is_refused() -> None:
    model = CNN()
    ctl, _ = _controller(model)
    with pytest.raises(ConfigError, match=r"already has a memctl\.Controller attached"):
        memctl.Controller(model, monitor_interval_s=0)
    with pytest.raises(ConfigError, match=r"already has a memctl\.Controller attached"):
        memctl.Controller(model.block1, monitor_interval_s=0)  # a part of a managed model
    ctl.detach()
    ctl2, opt2 = _controller(model)  # after detach, a new one attaches
    _step(model, opt2)
    assert ctl2.stats()["step"] == 1
    ctl2.detach()


# -- property: no memctl hook survives detach -------------------------------------------

class HookLifecycle(RuleBasedStateMachine):
    """Any sequence of attach/forward/backward/step/raise/eval/detach leaves nothing behind."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = _Flaky()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.ctl: memctl.Controller | None = None
        self.retired: list[memctl.Controller] = []
        self.loss: torch.Tensor | None = None
        self.stale = False
        """Whether an optimizer step changed the weights the pending loss's graph saved."""

    def _batch(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 64), torch.randint(0, 10, (n,))

    @precondition(lambda self: self.ctl is None)
    @rule()
    def attach(self) -> None:
        self.ctl = memctl.Controller(self.model, self.opt, monitor_interval_s=0, min_numel=64)

    @rule(n=st.integers(1, 8))
    def forward(self, n: int) -> None:
        x, y = self._batch(n)
        self.loss = nn.functional.cross_entropy(self.model(x), y)
        self.stale = False

    @precondition(lambda self: self.loss is not None)
    @rule()
    def backward(self) -> None:
        assert self.loss is not None
        if self.stale:  # plain PyTorch refuses it too; memctl says the same (NOTE [ In-place checks ])
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                self.loss.backward()
        else:
            self.loss.backward()
        self.loss = None

    @rule()
    def step(self) -> None:
        if self.loss is not None and any(p.grad is not None for p in self.model.parameters()):
            self.stale = True  # SGD moves only the parameters that have a gradient
        self.opt.step()
        self.opt.zero_grad()

    @rule()
    def raise_in_forward(self) -> None:
        self.model.fail = True
        try:
            self.model(self._batch(4)[0])
        except ValueError:
            pass
        finally:
            self.model.fail = False

    @rule(grad=st.booleans())
    def eval_forward(self, grad: bool) -> None:
        self.model.eval()
        with torch.set_grad_enabled(grad):
            self.model(self._batch(4)[0])
        self.model.train()

    @precondition(lambda self: self.ctl is not None)
    @rule(other_thread=st.booleans())
    def detach(self, other_thread: bool) -> None:
        assert self.ctl is not None
        if other_thread:
            t = threading.Thread(target=self.ctl.detach)
            t.start()
            t.join()
        else:
            self.ctl.detach()
            assert _hook_stack_top() is None
        self.retired.append(self.ctl)
        self.ctl = None

    @invariant()
    def detached_means_plain(self) -> None:
        if self.ctl is not None:
            return
        assert _memctl_hooks(self.model) == 0
        packs = [c._packer.packs for c in self.retired]
        x, y = self._batch(2)
        nn.functional.cross_entropy(self.model(x), y).backward()
        self.model.zero_grad()
        assert [c._packer.packs for c in self.retired] == packs, "a detached controller packed"
        assert _hook_stack_top() is None, "a memctl hook is left on autograd's stack"

    def teardown(self) -> None:
        if self.ctl is not None:
            self.ctl.detach()
        self.loss = None
        self.model(self._batch(2)[0]).sum().backward()  # lets inert hooks leave the stack
        assert _hook_stack_top() is None


TestHookLifecycle = HookLifecycle.TestCase
TestHookLifecycle.settings = settings(
    max_examples=25, stateful_step_count=12, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_in_place_wording_follows_the_installed_pytorch(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ In-place checks ]: an older PyTorch's wording (node with its suffix, other hint) is
    what memctl's error then says."""
    from memctl.controller import versions

    monkeypatch.setattr(versions, "autograd_wording",
                        lambda: (True, (" Hint: an older hint.", " Hint: an older anomaly hint.")))
    a = torch.ones(3, requires_grad=True)
    b = a.exp()
    saved_version = b._version
    with torch.no_grad():
        b.add_(1.0)
    with pytest.raises(RuntimeError) as info:
        versions.check_version(b, saved_version)
    assert "which is output 0 of ExpBackward0," in str(info.value)
    assert str(info.value).endswith("expected version 0 instead. Hint: an older hint.")
