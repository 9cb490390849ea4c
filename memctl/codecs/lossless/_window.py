"""Pooling indices as their position inside the pooling window (the ``window`` layout).

NOTE [ Window codes ]
Max-pool saves, for every output value, the flat index ``ih·W + iw`` of the input value
it took, an int64 in ``[0, H·W)``; narrowing (NOTE [ Integer narrowing ]) stores it in
8 or 16 bits. But each index lies inside its own pooling window: with stride ``s``,
padding ``p`` and window extent ``k`` (``dilation·(kernel − 1) + 1``) per dimension,

    ih = oh·s_h − p_h + dh,   iw = ow·s_w − p_w + dw,   0 <= dh < k_h, 0 <= dw < k_w,

so the pair ``(dh, dw)`` (``dh·k_w + dw``) is all that is needed: 2 bits for a 2x2 window,
4 for 3x3, against 8 or 16 narrowed. The codec does not know the pool's geometry (an
index tensor does not say which op made it), so :func:`find_window` tries the common
geometries (kernel 2 to 4, stride 1 to 4, padding up to half the kernel, the input
widths those give for the output width) on the first plane, and keeps the first one
under which *every* index of the tensor lies inside its window. Decoding computes
``(oh·s_h − p_h + dh)·W + (ow·s_w − p_w + dw)``, which is ``(x // W)·W + x % W = x`` for
the verified geometry: the round trip is exact by construction, whatever the data, and a
tensor no geometry fits keeps the narrowed layout. The code's bit planes are bit-packed
as bool masks are, so every implementation writes the same bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

__all__ = ["Window", "codes", "find_window", "indices"]

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
    dh, dw = _offsets(planes, w)
    inside = (dh >= 0) & (dh < w.size_h) & (dw >= 0) & (dw < w.size_w)
    return bool(inside.all())


def _candidates(oh: int, ow: int) -> list[Window]:
    out = []
    for k in (2, 3, 4):
        for s in (k, 2, 1, 3, 4):
            for p in range(k // 2 + 1):
                if s > k and p:
                    continue
                base = (ow - 1) * s + k - 2 * p  # input width for floor mode; ceil mode: up to s-1 less
                for width in range(max(base - s + 1, 1), base + s):
                    w = Window(width, s, s, p, p, k, k)
                    if w not in out:
                        out.append(w)
    return out


def find_window(x: torch.Tensor) -> Window | None:
    """A geometry under which every index of ``x`` lies in its window (NOTE [ Window codes ])."""
    if x.dtype not in _DTYPES or x.dim() < 3 or x.numel() < _MIN_NUMEL:
        return None
    oh, ow = x.shape[-2], x.shape[-1]
    planes = x.reshape(-1, oh, ow)
    first = planes[0]
    corners = [(r, c) for r in (0, oh - 1) for c in (0, ow - 1)]
    values = [int(v) for v in first[[r for r, _ in corners], [c for _, c in corners]].tolist()]
    for w in _candidates(oh, ow):
        if w.bits < 8 and all(_fits_one(v, r, c, w) for v, (r, c) in zip(values, corners, strict=True)) \
                and _fits(first, w) and _fits(planes, w):
            return w
    return None


def _fits_one(value: int, row: int, col: int, w: Window) -> bool:
    dh = value // w.width - (row * w.stride_h - w.pad_h)
    dw = value % w.width - (col * w.stride_w - w.pad_w)
    return 0 <= dh < w.size_h and 0 <= dw < w.size_w


def codes(x: torch.Tensor, w: Window) -> list[torch.Tensor]:
    """The window codes of ``x`` as ``w.bits`` flat bool planes, least significant first."""
    oh, ow = x.shape[-2], x.shape[-1]
    dh, dw = _offsets(x.reshape(-1, oh, ow), w)
    code = (dh * w.size_w + dw).reshape(-1)
    return [((code >> b) & 1).to(torch.bool) for b in range(w.bits)]


def indices(planes: list[torch.Tensor], w: Window, shape: tuple[int, ...],
            dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`codes`: the original index tensor."""
    oh, ow = shape[-2], shape[-1]
    code = torch.zeros(planes[0].shape, dtype=torch.int64, device=planes[0].device)
    for b, plane in enumerate(planes):
        code |= plane.to(torch.int64) << b
    code = code.view(-1, oh, ow)
    rows, cols = _origins(w, oh, ow, code.device)
    ih = rows + torch.div(code, w.size_w, rounding_mode="floor")
    iw = cols + torch.remainder(code, w.size_w)
    return (ih * w.width + iw).reshape(shape).to(dtype)
