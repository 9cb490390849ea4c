"""The pack/unpack pair a controller installs, and its per-step accounting.

The hook contract (as for ``torch.autograd.graph.save_on_cpu``): ``unpack(pack(t))``
equals ``t`` up to the layer's codec error, with ``t``'s shape, dtype and device.

NOTE [ What is compressed ]
- Parameters and buffers (recognised by their storage) are saved as they are: they
  change only in the optimizer step, after the backward pass has read them.
- Non-float tensors (max-pool indices, bool masks, targets) go to the lossless codec.
- Float tensors below ``min_numel`` values are copied, not compressed.
- Float tensors saved outside the model's forward (the loss) and log-softmax outputs are
  copied, not compressed: they are small, and their backward exponentiates them, so a
  quantisation error there grows exponentially (``compress_outside`` changes the first).
- Every other float tensor is compressed at its layer's bits (or error bound).
A copy is always taken: with saved-tensor hooks active, autograd no longer detects
in-place modification of a saved tensor, so keeping the original object would give
silently wrong gradients after an in-place op (DESIGN.md §5).

NOTE [ De-duplication ]
One tensor is often saved twice in a step (a ReLU output by relu and by max_pool). A
second save with the same storage, offset, shape, stride, dtype and version reuses the
first record. The record holds a weak reference to the first tensor and is reused only
while that tensor is alive, so a new tensor that happens to reuse a freed address is
never mistaken for the old one.

NOTE [ ReLU masks ]
Generalised to every op whose backward branches on its saved tensor: see
NOTE [ Derivative regions ] in ``memctl/controller/regions.py``. A float tensor produced by
such an op (recognised by its ``grad_fn``), or saved as the input of one (recognised by
the op's node when it appears, NOTE [ Finding the op that saved a tensor ]), also keeps
an exact 1- or 2-bit region code (the lossless codec's bit-packed bools), and decoding
puts every value back inside its true region: for ReLU, every positive value above zero
and every zero at exactly zero. The same record serves the next layer, which reads the
quantised values (ActNN keeps such a mask too). The code's bytes count as the layer's
``mask_bytes``, so the allocation prices them.

NOTE [ Codec fallback ]
If a codec raises, the tensor is kept as an uncompressed copy, the event is counted and
logged (a warning the first time per layer), and training goes on.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch

from memctl.codecs.base import Codec, Packed
from memctl.controller.config import KEEP_BITS, CodecMode, ControllerConfig
from memctl.controller.hooks import ROOT, ModuleTracker
from memctl.controller.regions import Partition, RegionCode, RegionTracker, result_partition
from memctl.controller.stats import LayerStep
from memctl.errors import CodecError

__all__ = ["Packer", "Saved"]

_log = logging.getLogger("memctl.controller")

# grad_fn names of ops whose saved output is never quantised (NOTE [ What is compressed ]).
_EXACT_OPS = frozenset({"LogSoftmaxBackward0", "LogSoftmaxBackward1"})

_DedupKey = tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype, torch.device, int]


class Saved:
    """What the pack hook returns: a packed record, a copy, or a parameter reference."""

    __slots__ = ("__weakref__", "data", "device", "dtype", "layer", "regions", "shape")

    def __init__(self, data: Packed | torch.Tensor, like: torch.Tensor, regions: tuple[RegionCode, ...] = (),
                 layer: str | None = None) -> None:
        self.data = data
        self.regions = regions
        self.layer = layer
        """The layer whose bits decide this record (None: not under the allocation's control)."""
        self.shape = like.shape
        self.dtype = like.dtype
        self.device = like.device


class Packer:
    """Installs nothing itself: the controller hands :meth:`pack` and :meth:`unpack` to autograd."""

    def __init__(
        self,
        config: ControllerConfig,
        tracker: ModuleTracker,
        choice_for: Callable[[str], tuple[float, float | None]],
        on_fallback: Callable[[str, BaseException], None],
    ) -> None:
        self._config = config
        self._tracker = tracker
        self._choice_for = choice_for
        self._on_fallback = on_fallback
        self._codecs: dict[str, Codec] = {}
        self._param_ptrs: frozenset[int] = frozenset()
        self._seen: dict[_DedupKey, tuple[weakref.ref[torch.Tensor], Saved]] = {}
        self._step: dict[str, LayerStep] = {}
        self._regions = RegionTracker()
        self._counter = 0
        self._seed_base = 0
        self.packs = 0

    # -- step lifecycle -------------------------------------------------------------
    def set_parameters(self, model: torch.nn.Module) -> None:
        """Remember the storages of the model's parameters and buffers."""
        ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
        ptrs |= {b.untyped_storage().data_ptr() for b in model.buffers()}
        self._param_ptrs = frozenset(ptrs)

    def begin_step(self, step: int) -> None:
        self._seed_base = (step * 0x9E3779B1) & 0xFFFFFFFF
        self._counter = 0
        self._regions.clear()

    def finish_step(self) -> dict[str, LayerStep]:
        """The step's per-layer records; resets them and the de-duplication table."""
        done, self._step = self._step, {}
        self._seen.clear()
        self._regions.clear()
        return done

    def record(self, layer: str) -> LayerStep:
        rec = self._step.get(layer)
        if rec is None:
            rec = self._step[layer] = LayerStep()
        return rec

    # -- hooks -------------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> Saved | torch.Tensor:
        """Pack hook (see NOTE [ What is compressed ])."""
        if t.layout != torch.strided or t.device.type == "meta":
            return t.detach().clone()
        self.observe(t)
        ptr = t.untyped_storage().data_ptr()
        if ptr in self._param_ptrs:
            return t
        key: _DedupKey = (ptr, int(t.storage_offset()), tuple(t.shape), tuple(t.stride()), t.dtype,
                          t.device, t._version)
        hit = self._seen.get(key)
        if hit is not None and hit[0]() is not None:
            saved = hit[1]
        else:
            saved = self._pack_new(t, self._tracker.current)
            self._seen[key] = (weakref.ref(t), saved)
        if saved.layer is not None:
            self._regions.note(t, saved, saved.layer)
        return saved

    def observe(self, output: Any) -> None:
        """Match pending inputs against a module's output (NOTE [ Finding the op that saved a tensor ])."""
        if isinstance(output, dict):
            items = list(output.values())
        else:
            items = list(output) if isinstance(output, tuple | list) else [output]
        for t in items:
            if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                for pending, part in self._regions.matches(t):
                    self._attach_region(pending.saved, part, pending.source, pending.layer)

    def unpack(self, saved: Saved | torch.Tensor) -> torch.Tensor:
        """Unpack hook: decode and check that shape and dtype came back unchanged."""
        self._regions.clear()  # the forward is over: no pending input can still be matched
        if isinstance(saved, torch.Tensor):
            return saved
        data = saved.data
        if isinstance(data, torch.Tensor):
            return data
        out = self._codec(data.codec).decode(data)
        if out.dtype != saved.dtype or out.shape != saved.shape or out.device != saved.device:
            raise CodecError(
                f"codec {data.codec!r} decoded a {tuple(out.shape)} {out.dtype} tensor on {out.device} "
                f"for a saved {tuple(saved.shape)} {saved.dtype} tensor on {saved.device}; "
                "this is a bug in the codec, please report it"
            )
        for region in saved.regions:
            code = torch.zeros(saved.shape, dtype=torch.uint8, device=out.device)
            for bit, plane in enumerate(region.planes):
                code |= self._codec("lossless").decode(plane).to(torch.uint8) << bit
            out = region.partition.project(out, code)
        return out

    # -- internals -------------------------------------------------------------------
    def _pack_new(self, t: torch.Tensor, layer: str) -> Saved:
        self.packs += 1
        rec = self.record(layer)
        rec.tensors += 1
        nbytes = t.numel() * t.element_size()
        if not t.is_floating_point():
            try:
                p = self._codec("lossless").encode(t)
            except Exception as exc:  # see NOTE [ Codec fallback ]
                self._on_fallback(layer, exc)
                rec.other_bytes += nbytes
                return Saved(t.detach().clone(), t)
            rec.other_bytes += p.nbytes
            return Saved(p, t)
        rec.raw_bytes += nbytes
        exact = (layer == ROOT and not self._config.compress_outside) or (
            t.grad_fn is not None and type(t.grad_fn).__name__ in _EXACT_OPS
        )
        if exact or t.numel() < self._config.min_numel:
            rec.fixed_bytes += nbytes
            rec.packed_bytes += nbytes
            return Saved(t.detach().clone(), t)
        rec.numels.append(t.numel())
        rec.element_size = t.element_size()
        part = result_partition(t.grad_fn)
        mask_nbytes = part.nbytes(t.numel()) if part is not None else 0
        rec.mask_bytes += mask_nbytes
        bits, error_bound = self._choice_for(layer)
        if bits >= KEEP_BITS:
            rec.bit_values += 8 * t.element_size() * t.numel()
            rec.packed_bytes += nbytes
            return Saved(t.detach().clone(), t, layer=layer)
        self._counter += 1
        seed = (self._seed_base + self._counter * 0x85EBCA6B) & 0xFFFFFFFF
        try:
            p, region = self._compress(t, bits, error_bound, seed, part)
        except Exception as exc:  # see NOTE [ Codec fallback ]
            self._on_fallback(layer, exc)
            rec.fixed_bytes += nbytes
            rec.packed_bytes += nbytes
            rec.numels.pop()
            rec.mask_bytes -= mask_nbytes
            return Saved(t.detach().clone(), t)
        if region is not None:
            rec.packed_bytes += region.nbytes
        rec.bit_values += bits * t.numel()
        rec.packed_bytes += p.nbytes
        self._range_stats(t, p, rec)
        return Saved(p, t, () if region is None else (region,), layer=layer)

    def _compress(self, t: torch.Tensor, bits: float, error_bound: float | None,
                  seed: int, part: Partition | None) -> tuple[Packed, RegionCode | None]:
        data = t.detach()
        if self._config.codec is CodecMode.ERRORBOUND and error_bound is not None:
            p = self._codec("errorbound").encode(data, error_bound=error_bound)
        else:
            p = self._codec("quantize").encode(data, bits=int(bits), seed=seed)
        return p, None if part is None else self._region_code(data, part)

    def _region_code(self, data: torch.Tensor, part: Partition) -> RegionCode:
        lossless = self._codec("lossless")
        return RegionCode(part, tuple(lossless.encode(plane) for plane in part.planes(data)))

    def _attach_region(self, saved: Saved, part: Partition, source: torch.Tensor, layer: str) -> None:
        """Add the region code of a packed input whose saving op is now known (NOTE [ ReLU masks ])."""
        if any(r.partition == part for r in saved.regions):
            return
        rec = self.record(layer)
        rec.mask_bytes += part.nbytes(source.numel())
        if not isinstance(saved.data, Packed):
            return  # kept uncompressed: exact already, the bytes only price the choice
        try:
            region = self._region_code(source.detach(), part)
        except Exception as exc:  # see NOTE [ Codec fallback ]: the values stay as quantised
            self._on_fallback(layer, exc)
            return
        saved.regions = (*saved.regions, region)
        rec.packed_bytes += region.nbytes

    def _range_stats(self, t: torch.Tensor, p: Packed, rec: LayerStep) -> None:
        """G·Σ_g R_g² and the value range, from the quantiser's group metadata when present."""
        g = self._config.group_size
        meta = p.buffers.get("meta")
        if meta is not None and meta.dim() == 2 and meta.shape[1] == 2:
            lo, hi = meta[:, 0].float(), meta[:, 1].float()
        else:
            flat = t.detach().reshape(-1).float()
            pad = (-flat.numel()) % g
            finite = torch.isfinite(flat)
            lo_src = torch.where(finite, flat, torch.inf)
            hi_src = torch.where(finite, flat, -torch.inf)
            if pad:
                lo_src = torch.nn.functional.pad(lo_src, (0, pad), value=torch.inf)
                hi_src = torch.nn.functional.pad(hi_src, (0, pad), value=-torch.inf)
            lo = lo_src.view(-1, g).amin(dim=1)
            hi = hi_src.view(-1, g).amax(dim=1)
            ok = torch.isfinite(lo) & torch.isfinite(hi)
            lo, hi = torch.where(ok, lo, 0.0), torch.where(ok, hi, 0.0)
        rng = (hi.double() - lo.double())
        rec.range_terms.append(rng.square().sum() * g)
        rec.mins.append(lo.min())
        rec.maxs.append(hi.max())

    def _codec(self, name: str) -> Codec:
        codec = self._codecs.get(name)
        if codec is None:
            from memctl import codecs

            config: dict[str, Any] = {}
            if name in ("quantize", "errorbound"):
                config["group_size"] = self._config.group_size
            codec = self._codecs[name] = codecs.get(name, **config)
        return codec
