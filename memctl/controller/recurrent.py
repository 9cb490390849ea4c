"""Recurrent layers that save their sequences, not every gate of every time step.

NOTE [ Fused recurrent layers ]
On a CPU, ``nn.GRU`` and ``nn.RNN`` run as one op per call (``torch.gru``,
``torch.rnn_tanh``) whose autograd graph is the cell written out for every time step: a
2-layer GRU over 48 steps saves ~870 tensors of one batch row each (gate results, their
products, slices; an RNN ~3 a step), each a pack and an unpack through memctl's Python
hooks, and those per-op records at 2 bits left the GRU's weight gradient 0.37-0.53 of its
norm off the exact one. A float32 ``nn.LSTM`` runs on oneDNN, whose backward keeps every gate of every step in
a byte workspace that memctl can only hold as it is (23 MiB of the 25 MiB a 2-layer LSTM of
128 over 48 steps at batch 32 saves). What a layer's backward needs is less: its input
sequence ``x`` and its initial state, and, to avoid running the layer again, its output
sequence ``h``.

So inside an attached ``nn.GRU``/``nn.LSTM``/``nn.RNN`` (a torch-function mode pushed by its
pre-hook and popped by its post-hook: the module is untouched) its op runs per layer and
direction as a :class:`torch.autograd.Function` whose forward is PyTorch's op without a
graph:

- GRU and RNN: it saves ``x``, ``h0`` and the output, two sequence-sized records a layer.
  The backward recomputes every gate (pre-activation) from them at once, two matmuls over
  the whole sequence, runs through time in 3-5 ops a step, and ends with three matmuls for
  the weight gradients, as cuDNN's fused RNN does with its reserve. About as fast as
  PyTorch's op on the GRU of ``benchmarks/training.py``. A ReLU RNN also saves its output's
  sign (1 bit a value, lossless) and takes its derivative from it: recomputed from the
  rounded sequences, pre-activations near 0 flip sign (8-bit cosine 0.99976, now above
  0.9999 as the others).
- LSTM: it saves ``x``, ``h0`` and ``c0``, one sequence-sized record a layer, and the
  backward runs the layer again from them through PyTorch's op (oneDNN) with a graph, its
  saved tensors held as they are for that moment. That was faster here than the GRU's way
  written for the LSTM (1.34x against 1.77x PyTorch's op alone, per layer: oneDNN's forward
  is quick, and its backward is fused where a loop in Python is not), and the gradient then
  carries the rounding of ``x`` alone.

The outputs, the final states, the dropout between layers and the RNG it draws are
PyTorch's; the gradients match PyTorch's to float rounding when the records are exact
(``tests/controller/test_recurrent.py``). A backward asked to build a graph
(``create_graph=True``) recomputes a GRU or RNN layer through PyTorch's op as well, so
gradients of gradients stay exact in form. A GRU's and an RNN's output is saved, as cuDNN
and oneDNN save theirs: changed in place before the backward, it raises autograd's in-place
error, as PyTorch's own LSTM on a CPU and every RNN on a GPU do (PyTorch's CPU GRU and RNN
save none). An LSTM's output is not saved, and changing it in place is harmless.

What stays on PyTorch's path: packed sequences, LSTM projections (``proj_size``), dtypes
other than float32/float64, devices other than the CPU (cuDNN and MIOpen already fuse the
layer and save a handful of tensors), inputs or weights of tensor subclasses, and a forward
without gradients, under autocast or under a ``torch.func`` transform.
``Controller(..., fused_rnn=False)`` keeps every layer there.

NOTE [ No 1 bit for a recurrent layer ]
A recurrent layer's backward runs its forward again through time from its saved input (the
LSTM above, oneDNN's and cuDNN's reserve aside) or reads the gates through the saved output:
the rounding of one step is carried through every later one, a function of the record far from
linear. The calibration's replays of such a layer alone at 1 bit measured what the allocation
in use then did not: on the LSTM of ``benchmarks/convergence.py --tasks text-lstm`` (seed 0),
``rnn`` at 1 bit measured 0.0010 (2 bits 0.00063; the estimate, at least 4x 2 bits', 0.0030:
under the default policy's bound), and the allocation in use with it at 1 bit measured 0.040 at
step 150, 27 times the prediction; the run ended +5.0% above plain's validation loss (with the
head's input at 8 bits, NOTE [ The head's input ] in heads.py; +0.6% with this floor). So every
``nn.RNNBase`` module (GRU, LSTM, RNN, fused or not) takes at least 2 bits (:data:`LEAST_BITS`),
a floor of the same kind as the calibration's evidence floors: dropped when a budget cannot be
met with it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from memctl.controller.copysafe import ControllerHook  # NOTE [ Copies of an attached model ]

__all__ = ["LEAST_BITS", "RecurrentMode", "attach_recurrent", "fused_gru", "fused_lstm", "recurrent_layers"]

LEAST_BITS = 2.0
"""The least bits of a recurrent layer (NOTE [ No 1 bit for a recurrent layer ])."""

_log = logging.getLogger("memctl.controller")


def recurrent_layers(model: torch.nn.Module) -> frozenset[str]:
    """The layer names of ``model``'s recurrent modules (NOTE [ No 1 bit for a recurrent layer ])."""
    return frozenset(name for name, m in model.named_modules() if name and isinstance(m, torch.nn.RNNBase))

_DTYPES = (torch.float32, torch.float64)


class RecurrentMode(TorchFunctionMode):
    """Runs ``torch.gru``/``torch.lstm``/``torch.rnn_tanh``/``torch.rnn_relu`` as fused layers
    (NOTE [ Fused recurrent layers ])."""

    def __init__(self) -> None:
        super().__init__()
        self.fused = 0
        """Calls of a recurrent op run fused (one a module call, whatever its layers)."""
        self._failed = False

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        fused = _FUSED.get(func)
        if not kwargs and fused is not None:
            try:
                out = fused(args)
            except Exception as exc:  # PyTorch's own op then runs: training goes on
                if not self._failed:
                    self._failed = True
                    _log.warning("memctl: fused %s failed (%s: %s); the layer runs as PyTorch's op",
                                 getattr(func, "__name__", func), type(exc).__name__, exc)
                out = None
            if out is not None:
                self.fused += 1
                return out
        return func(*args, **(kwargs or {}))


def attach_recurrent(model: torch.nn.Module, mode: RecurrentMode) -> list[torch.utils.hooks.RemovableHandle]:
    """Hooks that run ``mode`` inside every ``nn.GRU``, ``nn.LSTM`` and ``nn.RNN`` of ``model``; their
    handles."""
    local = threading.local()  # torch-function modes are per thread, and so is what was entered

    def enter(module: torch.nn.Module, args: Any) -> None:
        inside = not torch.compiler.is_compiling() and torch.is_grad_enabled()
        if inside:
            mode.__enter__()
        entered = getattr(local, "entered", None)
        if entered is None:
            entered = local.entered = []
        entered.append(inside)

    def leave(module: torch.nn.Module, args: Any, output: Any) -> None:
        entered = getattr(local, "entered", None)
        if entered and entered.pop():
            mode.__exit__(None, None, None)

    handles = []
    for module in model.modules():
        if isinstance(module, (torch.nn.GRU, torch.nn.LSTM, torch.nn.RNN)):
            handles.append(module.register_forward_pre_hook(ControllerHook(enter)))
            handles.append(module.register_forward_hook(ControllerHook(leave), always_call=True))
    return handles


def _plain(t: Any) -> bool:
    return type(t) is torch.Tensor or type(t) is torch.nn.Parameter


def _supported(x: Any, states: Sequence[Any], params: Sequence[Any], has_biases: bool, layers: int,
               dirs: int, gates: int) -> bool:
    if not torch.is_grad_enabled() or not _plain(x) or x.dim() != 3 or x.dtype not in _DTYPES:
        return False
    if torch._C._are_functorch_transforms_active():  # torch.func: an autograd.Function needs more there
        return False
    if x.device.type != "cpu" or torch.is_autocast_enabled("cpu"):  # autocast: its own dtypes per op
        return False
    per = 4 if has_biases else 2
    if len(params) != layers * dirs * per or not all(_plain(p) for p in params):
        return False
    if not all(_plain(s) and s.dtype == x.dtype and s.device == x.device and s.dim() == 3 for s in states):
        return False
    hidden = states[0].shape[2]
    for k, p in enumerate(params):
        if p.dtype != x.dtype or p.device != x.device:
            return False
        if k % per == 1 and tuple(p.shape) != (gates * hidden, hidden):  # an LSTM projection: not here
            return False
    return x.requires_grad or any(p.requires_grad for p in params) or any(s.requires_grad for s in states)


_Weights = tuple[Any, Any, Any, Any]


def _layer_params(params: Sequence[Any], index: int, has_biases: bool) -> _Weights:
    per = 4 if has_biases else 2
    w = params[index * per:(index + 1) * per]
    return (w[0], w[1], w[2], w[3]) if has_biases else (w[0], w[1], None, None)


LayerFn = Callable[[torch.Tensor, int, bool, _Weights], tuple[torch.Tensor, torch.Tensor | None]]


def _stack(args: Sequence[Any], layer_fn: LayerFn) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The layers and directions of a checked ``torch.gru``/``torch.lstm`` call, each by ``layer_fn(seq,
    index, reverse, weights)`` -> (output sequence, final cell or None), with PyTorch's dropout
    between layers: the output, the final states and the final cells."""
    x, _, params, has_biases, layers, dropout, train, bidirectional, batch_first = args
    dirs = 2 if bidirectional else 1
    seq = x.transpose(0, 1) if batch_first else x
    finals: list[torch.Tensor] = []
    cells: list[torch.Tensor] = []
    for layer in range(layers):
        outs = []
        for d in range(dirs):
            index = layer * dirs + d
            out, cell = layer_fn(seq, index, d == 1, _layer_params(params, index, bool(has_biases)))
            outs.append(out)
            finals.append(out[-1] if d == 0 else out[0])
            if cell is not None:
                cells.append(cell)
        seq = outs[0] if dirs == 1 else torch.cat(outs, 2)
        if dropout and train and layer < layers - 1:
            seq = F.dropout(seq, dropout, True)
    return (seq.transpose(0, 1) if batch_first else seq), torch.stack(finals), cells


def fused_lstm(args: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``torch.lstm(input, (h0, c0), params, ...)`` run fused, or None (NOTE [ Fused recurrent layers ])."""
    if len(args) != 9 or not isinstance(args[1], (list, tuple)) or not isinstance(args[2], (list, tuple)):
        return None
    x, hx, params, has_biases, layers, _, _, bidirectional, _ = args
    dirs = 2 if bidirectional else 1
    if len(hx) != 2 or not _supported(x, tuple(hx), params, bool(has_biases), int(layers), dirs, 4):
        return None
    h0, c0 = hx
    if h0.shape != c0.shape:
        return None

    def layer(seq: torch.Tensor, index: int, reverse: bool, w: _Weights) -> tuple[Any, Any]:
        out, cell = _LSTMLayer.apply(seq, h0[index], c0[index], reverse, *w)
        return out, cell

    out, finals, cells = _stack(args, layer)
    return out, finals, torch.stack(cells)


def _fused_single(gates: int, apply: Callable[[torch.Tensor, torch.Tensor, bool, _Weights], torch.Tensor]
                  ) -> Callable[[Sequence[Any]], tuple[torch.Tensor, torch.Tensor] | None]:
    """``torch.gru``/``torch.rnn_tanh``/``torch.rnn_relu(input, hx, params, has_biases, num_layers,
    dropout, train, bidirectional, batch_first)`` run fused, each layer and direction by
    ``apply(seq, h0, reverse, weights)``, or None where PyTorch's op must run (NOTE [ Fused
    recurrent layers ])."""

    def fused(args: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor] | None:
        if len(args) != 9 or not isinstance(args[2], (list, tuple)):
            return None  # a packed sequence: (data, batch_sizes, hx, params, ...)
        x, hx, params, has_biases, layers, _, _, bidirectional, _ = args
        if not _supported(x, (hx,), params, bool(has_biases), int(layers), 2 if bidirectional else 1, gates):
            return None

        def layer(seq: torch.Tensor, index: int, reverse: bool, w: _Weights) -> tuple[Any, None]:
            return apply(seq, hx[index], reverse, w), None

        out, finals, _ = _stack(args, layer)
        return out, finals

    return fused


fused_gru = _fused_single(3, lambda seq, h0, reverse, w: _GRULayer.apply(seq, h0, reverse, *w))

_FUSED: dict[Any, Callable[[Sequence[Any]], Any]] = {
    torch.gru: fused_gru, torch.lstm: fused_lstm,
    torch.rnn_tanh: _fused_single(1, lambda seq, h0, rev, w: _RNNLayer.apply(seq, h0, rev, False, *w)),
    torch.rnn_relu: _fused_single(1, lambda seq, h0, rev, w: _RNNLayer.apply(seq, h0, rev, True, *w)),
}


def _weights(w_ih: torch.Tensor, w_hh: torch.Tensor, b_ih: torch.Tensor | None,
             b_hh: torch.Tensor | None) -> list[torch.Tensor]:
    return [w_ih, w_hh] if b_ih is None or b_hh is None else [w_ih, w_hh, b_ih, b_hh]


def _affine(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``x @ w.T + b`` over every time step at once, as (T, B, rows)."""
    flat = x.reshape(-1, x.shape[-1])
    out = torch.mm(flat, w.t()) if b is None else torch.addmm(b, flat, w.t())
    return out.view(x.shape[0], x.shape[1], -1)


def _time_major(t: torch.Tensor, reverse: bool) -> torch.Tensor:
    return t.flip(0) if reverse else t


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _replayed(ctx: Any, fn: Callable[..., tuple[torch.Tensor, ...]], inputs: tuple[Any, ...],
              grads: tuple[Any, ...]) -> tuple[Any, ...]:
    """The gradients of a layer recomputed through PyTorch's op, ``fn(*inputs)``. Under
    ``create_graph`` (grad mode on in the backward) they are a graph of the saved tensors;
    otherwise the layer is recomputed from detached copies with its saved tensors held as they
    are, whatever saved-tensor hooks are on autograd's stack (memctl's passes a tensor saved
    inside a backward through anyway; a user's ``save_on_cpu`` would move them to the host and
    back for a graph that lives only in this backward)."""
    create = torch.is_grad_enabled()
    wanted = [i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and ctx.needs_input_grad[i]]
    if not create:
        inputs = tuple(t.detach().requires_grad_(i in wanted) if isinstance(t, torch.Tensor) else t
                       for i, t in enumerate(inputs))
    with torch.enable_grad(), contextlib.ExitStack() as stack:
        if not create:
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(_same, _same))
        outs = fn(*inputs)
        pairs = [(o, g) for o, g in zip(outs, grads, strict=True) if g is not None]
        got = torch.autograd.grad([o for o, _ in pairs], [inputs[i] for i in wanted], [g for _, g in pairs],
                                  create_graph=create, allow_unused=True)
    result: list[Any] = [None] * len(inputs)
    for i, g in zip(wanted, got, strict=True):
        result[i] = g
    return tuple(result)


class _GRULayer(torch.autograd.Function):
    """One GRU layer and direction over a time-major sequence (NOTE [ Fused recurrent layers ])."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, h0: torch.Tensor, reverse: bool, w_ih: torch.Tensor,
                w_hh: torch.Tensor, b_ih: torch.Tensor | None, b_hh: torch.Tensor | None) -> torch.Tensor:
        with torch.no_grad():
            out = _single(torch.gru, x, h0, reverse, w_ih, w_hh, b_ih, b_hh)
        ctx.save_for_backward(x, h0, out, w_ih, w_hh, b_ih, b_hh)
        ctx.reverse = reverse
        return out

    @staticmethod
    def backward(ctx: Any, gout: torch.Tensor) -> tuple[Any, ...]:
        x, h0, out, w_ih, w_hh, b_ih, b_hh = ctx.saved_tensors
        reverse = ctx.reverse
        if torch.is_grad_enabled():  # create_graph: through PyTorch's op
            def again(x: Any, h0: Any, _: Any, *w: Any) -> tuple[torch.Tensor]:
                return (_single(torch.gru, x, h0, reverse, *w),)

            return _replayed(ctx, again, (x, h0, None, w_ih, w_hh, b_ih, b_hh), (gout,))
        xs, hs, g = _time_major(x, reverse), _time_major(out, reverse), _time_major(gout, reverse)
        steps, batch, hidden = hs.shape
        hp = torch.cat([h0.unsqueeze(0), hs[:-1]])  # the state each step read
        gi = _affine(xs, w_ih, b_ih).view(steps, batch, 3, hidden)
        gh = _affine(hp, w_hh, b_hh).view(steps, batch, 3, hidden)
        rz = torch.sigmoid_(gi[:, :, :2] + gh[:, :, :2])
        r, z = rz[:, :, 0], rz[:, :, 1]
        h_n = gh[:, :, 2]
        n = torch.tanh_(torch.addcmul(gi[:, :, 2], r, h_n))
        # the step's gate gradients are its state gradient times these (the backward is linear in it)
        a = (1 - z).mul_(1 - n * n)
        coef = torch.empty(steps, batch, 3, hidden, dtype=hs.dtype)
        torch.mul(a * h_n, r * (1 - r), out=coef[:, :, 0])
        torch.mul(hp - n, z * (1 - z), out=coef[:, :, 1])
        torch.mul(a, r, out=coef[:, :, 2])
        del gi, gh, h_n, n, r  # (z stays: a view of rz) the backward's peak is the buffers below
        dh_all = torch.empty_like(hs)
        dgh_all = torch.empty_like(coef)
        coefs, zs, gs = coef.unbind(0), z.unbind(0), g.contiguous().unbind(0)
        dhs, dghs = dh_all.unbind(0), dgh_all.unbind(0)
        carry = None
        for t in range(steps - 1, -1, -1):
            dh = dhs[t]
            if carry is None:
                dh.copy_(gs[t])
            else:
                torch.add(gs[t], carry, out=dh)
            dgh = torch.mul(coefs[t], dh.unsqueeze(1), out=dghs[t])
            carry = torch.addmm(dh * zs[t], dgh.view(batch, 3 * hidden), w_hh)
        del coef, coefs
        need = ctx.needs_input_grad
        flat = dgh_all.view(steps * batch, 3 * hidden)
        dw_hh = torch.mm(flat.t(), hp.reshape(steps * batch, hidden)) if need[4] else None
        db_hh = flat.sum(0) if need[6] else None
        # the input gates' gradients differ from the hidden ones in the new gate's part only
        torch.mul(dh_all, a, out=dgh_all[:, :, 2])
        dx = _time_major(torch.mm(flat, w_ih).view_as(xs), reverse) if need[0] else None
        return (dx, carry if need[1] else None, None,
                torch.mm(flat.t(), xs.reshape(steps * batch, -1)) if need[3] else None,
                dw_hh, flat.sum(0) if need[5] else None, db_hh)


class _LSTMLayer(torch.autograd.Function):
    """One LSTM layer and direction over a time-major sequence (NOTE [ Fused recurrent layers ]):
    its input saved, the layer recomputed from it through PyTorch's op in the backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor, reverse: bool,
                w_ih: torch.Tensor, w_hh: torch.Tensor, b_ih: torch.Tensor | None,
                b_hh: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            out, _, c_last = _lstm(x, h0, c0, reverse, False, w_ih, w_hh, b_ih, b_hh)
        ctx.save_for_backward(x, h0, c0, w_ih, w_hh, b_ih, b_hh)
        ctx.reverse = reverse
        return out, c_last

    @staticmethod
    def backward(ctx: Any, gout: torch.Tensor, gc: torch.Tensor | None) -> tuple[Any, ...]:
        x, h0, c0, w_ih, w_hh, b_ih, b_hh = ctx.saved_tensors
        reverse = ctx.reverse

        def again(x: Any, h0: Any, c0: Any, _: Any, *w: Any) -> tuple[torch.Tensor, torch.Tensor]:
            out, _, c_last = _lstm(x, h0, c0, reverse, True, *w)
            return out, c_last

        return _replayed(ctx, again, (x, h0, c0, None, w_ih, w_hh, b_ih, b_hh), (gout, gc))


def _single(op: Any, x: torch.Tensor, h0: torch.Tensor, reverse: bool, *w: Any) -> torch.Tensor:
    """One layer and direction of ``torch.gru``/``torch.rnn_tanh``/``torch.rnn_relu`` (``op``): the
    output sequence, in ``x``'s time order."""
    out = op(_time_major(x, reverse), h0.unsqueeze(0), _weights(*w), w[2] is not None, 1, 0.0, False, False,
             False)[0]
    return _time_major(out, reverse)


def _lstm(x: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor, reverse: bool, train: bool, *w: Any
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer and direction of ``torch.lstm``: the output sequence (in ``x``'s time order), the
    final state and the final cell. ``train`` (no dropout in one layer) makes oneDNN keep what its
    backward needs."""
    out, h_last, c_last = torch.lstm(_time_major(x, reverse), (h0.unsqueeze(0), c0.unsqueeze(0)),
                                     _weights(*w), w[2] is not None, 1, 0.0, train, False, False)
    return _time_major(out, reverse), h_last[0], c_last[0]


class _RNNLayer(torch.autograd.Function):
    """One ``nn.RNN`` layer and direction (tanh or ReLU) over a time-major sequence (NOTE [ Fused
    recurrent layers ])."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, h0: torch.Tensor, reverse: bool, relu: bool, w_ih: torch.Tensor,
                w_hh: torch.Tensor, b_ih: torch.Tensor | None, b_hh: torch.Tensor | None) -> torch.Tensor:
        with torch.no_grad():
            out = _single(torch.rnn_relu if relu else torch.rnn_tanh, x, h0, reverse, w_ih, w_hh, b_ih, b_hh)
        # a ReLU's derivative from its exact region, as ReLU's own mask (1 bit a value, lossless)
        region = out > 0 if relu else None
        ctx.save_for_backward(x, h0, out, region, w_ih, w_hh, b_ih, b_hh)
        ctx.reverse, ctx.relu = reverse, relu
        return out

    @staticmethod
    def backward(ctx: Any, gout: torch.Tensor) -> tuple[Any, ...]:
        x, h0, out, region, w_ih, w_hh, b_ih, b_hh = ctx.saved_tensors
        reverse, relu = ctx.reverse, ctx.relu
        op = torch.rnn_relu if relu else torch.rnn_tanh
        if torch.is_grad_enabled():  # create_graph: through PyTorch's op
            def again(x: Any, h0: Any, _: Any, __: Any, *w: Any) -> tuple[torch.Tensor]:
                return (_single(op, x, h0, reverse, *w),)

            return _replayed(ctx, again, (x, h0, None, None, w_ih, w_hh, b_ih, b_hh), (gout,))
        xs, hs, g = _time_major(x, reverse), _time_major(out, reverse), _time_major(gout, reverse)
        steps, batch, hidden = hs.shape
        hp = torch.cat([h0.unsqueeze(0), hs[:-1]])
        if region is not None:  # ReLU: the exact region (a pre-activation recomputed from the
            slope = _time_major(region, reverse).to(hs.dtype)  # rounded sequences flips near 0)
        else:  # tanh: the pre-activations recomputed, as the gates are
            slope = torch.tanh_(_affine(xs, w_ih, b_ih).add_(_affine(hp, w_hh, b_hh)))
            slope = torch.mul(slope, slope).neg_().add_(1)
        dpre = torch.empty_like(slope)
        slopes, gs, dpres = slope.unbind(0), g.contiguous().unbind(0), dpre.unbind(0)
        carry: torch.Tensor | None = None
        for t in range(steps - 1, -1, -1):
            dh = gs[t] if carry is None else gs[t] + carry
            carry = torch.mm(torch.mul(dh, slopes[t], out=dpres[t]), w_hh)
        flat = dpre.view(steps * batch, hidden)
        need = ctx.needs_input_grad
        db = flat.sum(0) if need[6] or need[7] else None
        return (_time_major(torch.mm(flat, w_ih).view_as(xs), reverse) if need[0] else None,
                carry if need[1] else None, None, None,
                torch.mm(flat.t(), xs.reshape(steps * batch, -1)) if need[4] else None,
                torch.mm(flat.t(), hp.reshape(steps * batch, hidden)) if need[5] else None,
                db if need[6] else None, db if need[7] else None)
