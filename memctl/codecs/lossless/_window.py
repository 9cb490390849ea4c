"""Pooling indices as their position inside the pooling window (the ``window`` layout).

NOTE [ Window codes ]
Max-pool saves, for every output value, the flat index ``ih·W + iw`` of the input value
it took, an int64 in ``[0, H·W)``; narrowing (NOTE [ Integer narrowing ]) stores it in
8 or 16 bits. But each index lies inside its own pooling window: with stride ``s``,
padding ``p`` and window extent ``k`` (``dilation·(kernel − 1) + 1``) per dimension,

    ih = oh·s_h − p_h + dh,   iw = ow·s_w − p_w + dw,   0 <= dh < k_h, 0 <= dw < k_w,

so the pair ``(dh, dw)`` (``dh·k_w + dw``) is all that is needed: 2 bits for a 2x2 window,
4 for 3x3, against 8 or 16 narrowed. The codec does not know the pool's geometry (an
index tensor does not say which op made it), so :func:`window_codes` tries the common
geometries (kernel 2 to 4, stride 1 to 4, padding up to half the kernel, the input
widths those give for the output width) on the first plane, and keeps the first one
under which *every* index of the tensor lies inside its window. Decoding computes
``(oh·s_h − p_h + dh)·W + (ow·s_w − p_w + dw)``, which is ``(x // W)·W + x % W = x`` for
the verified geometry: the round trip is exact by construction, whatever the data, and a
tensor no geometry fits keeps the narrowed layout. The code's bit planes are bit-packed
as bool masks are, so every implementation writes the same bytes.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import torch

__all__ = ["Window", "indices", "window_codes"]

_MIN_NUMEL = 64
_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class Window:
    """A pooling geometry over the last two dimensions; ``bits`` per stored code."""

    width: int
    stride_h: int
    stride_w: int
    pad_h: int
    pad_w: int
    size_h: int
    size_w: int

    @property
    def bits(self) -> int:
        return max(1, (self.size_h * self.size_w - 1).bit_length())

    def to_params(self) -> dict[str, int]:
        return {"width": self.width, "stride_h": self.stride_h, "stride_w": self.stride_w,
                "pad_h": self.pad_h, "pad_w": self.pad_w, "size_h": self.size_h, "size_w": self.size_w}

    @classmethod
    def from_params(cls, params: Mapping[str, int | float | str]) -> Window:
        return cls(*(int(params[k]) for k in ("width", "stride_h", "stride_w", "pad_h", "pad_w",
                                            "size_h", "size_w")))


def _origins(w: Window, oh: int, ow: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.arange(oh, device=device, dtype=torch.int64).view(oh, 1) * w.stride_h - w.pad_h
    cols = torch.arange(ow, device=device, dtype=torch.int64).view(1, ow) * w.stride_w - w.pad_w
    return rows, cols


def _offsets(planes: torch.Tensor, w: Window) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = _origins(w, planes.shape[-2], planes.shape[-1], planes.device)
    x = planes.to(torch.int64)
    return torch.div(x, w.width, rounding_mode="floor") - rows, torch.remainder(x, w.width) - cols


def _fits(planes: torch.Tensor, w: Window) -> bool:
    return _codes_if_inside(planes, w) is not None


def _codes_if_inside(planes: torch.Tensor, w: Window) -> torch.Tensor | None:
    """The flat window codes ``dh·size_w + dw`` of ``planes`` under ``w``, or None when some index
    lies outside its window (one division pass serves both)."""
    dh, dw = _offsets(planes, w)
    inside = (dh >= 0) & (dh < w.size_h) & (dw >= 0) & (dw < w.size_w)
    if not bool(inside.all()):
        return None
    return (dh * w.size_w + dw).reshape(-1)


@functools.lru_cache(maxsize=64)
def _candidates(oh: int, ow: int) -> tuple[Window, ...]:
    out: dict[Window, None] = {}  # ordered, without repeats
    for k in (2, 3, 4):
        for s in (k, 2, 1, 3, 4):
            for p in range(k // 2 + 1):
                if s > k and p:
                    continue
                base = (ow - 1) * s + k - 2 * p  # input width for floor mode; ceil mode: up to s-1 less
                for width in range(max(base - s + 1, 1), base + s):
                    out[Window(width, s, s, p, p, k, k)] = None
    return tuple(out)


def window_codes(x: torch.Tensor) -> tuple[Window, list[torch.Tensor]] | None:
    """A geometry under which every index of ``x`` lies in its window (NOTE [ Window codes ]),
    and the window codes of ``x`` under it as ``bits`` flat bool planes, least significant
    first; None when no geometry fits. The codes come from the pass that checks the fit."""
    if x.dtype not in _DTYPES or x.dim() < 3 or x.numel() < _MIN_NUMEL:
        return None
    oh, ow = x.shape[-2], x.shape[-1]
    planes = x.reshape(-1, oh, ow)
    first = planes[0]
    corners = [(r, c) for r in (0, oh - 1) for c in (0, ow - 1)]
    values = [int(v) for v in first[[r for r, _ in corners], [c for _, c in corners]].tolist()]
    for w in _candidates(oh, ow):
        if w.bits < 8 and all(_fits_one(v, r, c, w) for v, (r, c) in zip(values, corners, strict=True)) \
                and (w in _FITTED or _fits(first, w)):
            code = _codes_if_inside(planes, w)
            if code is not None:
                if len(_FITTED) >= 256:
                    _FITTED.clear()
                _FITTED.add(w)
                return w, _bit_planes(code, w)
    return None


_FITTED: set[Window] = set()
"""Geometries that have fitted a whole tensor: the first plane's check, a fast way to reject a
wrong candidate, is skipped for them (the same answer: the whole tensor is checked anyway). A
model's pools meet the same geometries every step, and each check reads the tensor back, a
wait for the GPU: ResNet-18's max-pool waited five times a step on an H200, now twice."""


def _fits_one(value: int, row: int, col: int, w: Window) -> bool:
    dh = value // w.width - (row * w.stride_h - w.pad_h)
    dw = value % w.width - (col * w.stride_w - w.pad_w)
    return 0 <= dh < w.size_h and 0 <= dw < w.size_w


def _bit_planes(code: torch.Tensor, w: Window) -> list[torch.Tensor]:
    small = code.to(torch.uint8)  # a code is below 16 (a window of at most 4x4): 1 byte, not 8
    return [((small >> b) & 1).to(torch.bool) for b in range(w.bits)]


def indices(planes: list[torch.Tensor], w: Window, shape: tuple[int, ...],
            dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`window_codes`: the original index tensor."""
    oh, ow = shape[-2], shape[-1]
    device = planes[0].device
    code = planes[0].to(torch.uint8)
    for b, plane in enumerate(planes[1:], start=1):
        code |= plane.to(torch.uint8) << b
    # index = (row origin + dh)·W + col origin + dw = base[oh, ow] + step[code], with the
    # window's few steps dh·W + dw in a table: no integer division over the tensor.
    cells = torch.arange(w.size_h * w.size_w, device=device, dtype=torch.int64)
    step = torch.div(cells, w.size_w, rounding_mode="floor") * w.width + torch.remainder(cells, w.size_w)
    rows, cols = _origins(w, oh, ow, device)
    base = rows * w.width + cols
    out = step[code.to(torch.int64)].view(-1, oh, ow) + base
    return out.reshape(shape).to(dtype)
