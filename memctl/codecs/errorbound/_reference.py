"""The ``errorbound`` codec in plain PyTorch: the readable definition of the format.

Vectorised over groups, on whatever device the input lives. The Numba kernels in
:mod:`memctl.codecs.errorbound._kernels` must write the same bytes; see NOTE
[ errorbound format ] and NOTE [ errorbound arithmetic ] in :mod:`memctl.codecs.errorbound`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from memctl.codecs.errorbound._format import (
    EG_CLAMP,
    FLT_MAX,
    MAX_BITS,
    MODE_BITS,
    MODE_RAW,
    MODE_SPARSE,
    Q_LIMIT,
    STEP_FACTOR,
    DtypeSpec,
)

__all__ = ["decode", "encode"]

_BIG = 1 << 40  # above any |q| (<= 2^29): neutral element of the group min/max


def _groups(flat: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``flat`` zero-padded to whole groups, shape (groups, G), and the mask of real values."""
    n = flat.numel()
    n_groups = -(-n // group_size)
    pad = n_groups * group_size - n
    valid = torch.arange(n_groups * group_size, device=flat.device) < n
    return F.pad(flat, (0, pad)).view(n_groups, group_size), valid.view(n_groups, group_size)


def _bit_width(r: torch.Tensor) -> torch.Tensor:
    """Per entry, the smallest b (at most 31) with 2^b > r: bits for codes 0..r."""
    b = torch.zeros_like(r)
    for k in range(31):
        b += (r >= (1 << k)).long()
    return b


def _write_bits(total: int, pos: torch.Tensor, code: torch.Tensor, width: torch.Tensor) -> torch.Tensor:
    """A ``total``-byte buffer holding each ``width``-bit ``code`` at bit ``pos``, LSB first.

    The codes occupy disjoint bits, so adding each set bit's byte mask is the same as
    OR-ing it in.
    """
    acc = torch.zeros(total, dtype=torch.int32, device=pos.device)
    for k in range(32):
        sel = (width > k) & (((code >> k) & 1) == 1)
        p = pos[sel] + k
        acc.index_add_(0, p >> 3, (torch.ones_like(p) << (p & 7)).int())
    return acc.to(torch.uint8)


def _read_bits(payload: torch.Tensor, pos: torch.Tensor, width: torch.Tensor) -> torch.Tensor:
    """The ``width``-bit code at bit ``pos`` of ``payload`` for every entry (0 where width == 0)."""
    padded = torch.cat([payload, payload.new_zeros(5)]).long()  # reads may run 4 bytes past a code
    pos = torch.where(width > 0, pos, 0)
    code = torch.zeros_like(pos)
    for k in range(32):
        p = pos + k
        bit = (padded[p >> 3] >> (p & 7)) & 1
        code |= torch.where(width > k, bit << k, 0)
    return code


def encode(
    x32: torch.Tensor, xraw: torch.Tensor, group_size: int, error_bound: float, spec: DtypeSpec
) -> dict[str, torch.Tensor]:
    """The record's buffers for the flat float32 values ``x32`` (``xraw``: the input's bits)."""
    x, valid = _groups(x32, group_size)
    raw_bits, _ = _groups(xraw, group_size)
    n_groups = x.shape[0]
    length = valid.sum(1)
    x64 = x.double()

    # The group's effective bound e_g and step s_g.
    finite = x64.abs() <= FLT_MAX  # False for NaN and +-Inf
    ok = (finite | ~valid).all(1)
    m = torch.where(finite & valid, x64.abs(), 0.0).amax(1)
    e = error_bound
    if spec.cast_rel > 0.0:
        half_ulp = torch.clamp_min((m + e) * spec.cast_rel, spec.cast_min)
        eg = (e - half_ulp) * spec.shrink
    else:
        eg = torch.full((n_groups,), e, dtype=torch.float64, device=x.device)
    eg = eg.clamp_max(EG_CLAMP)
    ok &= eg > 0.0
    s32 = torch.where(ok, (eg * STEP_FACTOR).float(), 0.0)
    s = s32.double()
    ok &= s > 0.0

    # Codes on the zero-anchored grid, and what the decoder will make of them.
    s_col = s[:, None]
    in_range = x64.abs() <= Q_LIMIT * s_col
    usable = ok[:, None] & valid & in_range
    q = torch.floor(torch.where(usable, x64 / s_col, 0.0) + 0.5).long()
    prod = q.double() * s_col
    decoded = prod.float().double()
    good = in_range & (prod.abs() <= spec.vmax) & ((decoded - x64).abs() <= eg[:, None])
    ok &= (good | ~valid).all(1)

    qlo = torch.where(valid, q, _BIG).amin(1)
    qhi = torch.where(valid, q, -_BIG).amax(1)
    b = torch.where(ok, _bit_width(qhi - qlo), 0)
    ok &= b <= MAX_BITS
    raw = ~ok
    b = torch.where(raw, 0, b)

    # Mode and size: raw, dense codes, or a nonzero bitmap plus the nonzero codes.
    nonzero = (q != 0) & valid
    dense_bytes = (length * b + 7) // 8
    sparse_bytes = (length + nonzero.sum(1) * b + 7) // 8
    sparse = ok & (b > 0) & (sparse_bytes < dense_bytes)
    raw_bytes = length * spec.raw_width // 8
    size = torch.where(raw, raw_bytes, torch.where(sparse, sparse_bytes, dense_bytes))
    mode = torch.where(raw, MODE_RAW, torch.where(sparse, b | MODE_SPARSE, b)).to(torch.uint8)
    offset = torch.cumsum(size, 0) - size
    total = int(size.sum())  # one host sync: the payload's size (NOTE [ errorbound format ])

    # Bit positions: codes at j * width (dense, raw) or after the bitmap by rank (sparse).
    j = torch.arange(group_size, device=x.device)[None, :]
    group_bit = (offset * 8)[:, None]
    width = torch.where(raw, spec.raw_width, b)[:, None].expand_as(q)
    rank = torch.cumsum(nonzero.long(), 1) - nonzero.long()
    sparse_col = sparse[:, None]
    code_pos = torch.where(sparse_col, group_bit + length[:, None] + rank * width, group_bit + j * width)
    mask = (1 << spec.raw_width) - 1
    code = torch.where(raw[:, None], raw_bits.long() & mask, q - qlo[:, None])
    emit = valid & (~sparse_col | nonzero)
    bitmap = valid & sparse_col & nonzero
    bitmap_pos = (group_bit + j).expand_as(q)[bitmap]
    payload = _write_bits(
        total,
        torch.cat([code_pos[emit], bitmap_pos]),
        torch.cat([code[emit], torch.ones_like(bitmap_pos)]),
        torch.cat([width[emit], torch.ones_like(bitmap_pos)]),
    )
    return {
        "mode": mode,
        "qmin": torch.where(raw, 0, qlo).int(),
        "step": s32.masked_fill(raw, 0.0),
        "offset": offset,
        "payload": payload,
    }


def decode(buffers: dict[str, torch.Tensor], n: int, group_size: int, spec: DtypeSpec) -> torch.Tensor:
    """The ``n`` float32 values a record's buffers describe (raw values exactly, NaN kept)."""
    mode = buffers["mode"].long()
    n_groups = mode.numel()
    valid = (torch.arange(n_groups * group_size, device=mode.device) < n).view(n_groups, group_size)
    length = valid.sum(1)[:, None]
    raw = ((mode & MODE_RAW) != 0)[:, None]
    sparse = ((mode & MODE_SPARSE) != 0)[:, None]
    b = (mode & MODE_BITS)[:, None]
    payload = buffers["payload"]
    j = torch.arange(group_size, device=mode.device)[None, :]
    group_bit = (buffers["offset"] * 8)[:, None]

    in_bitmap = valid & sparse
    nonzero = (_read_bits(payload, (group_bit + j).expand(n_groups, -1), in_bitmap.long()) == 1) & in_bitmap
    rank = torch.cumsum(nonzero.long(), 1) - nonzero.long()
    width = torch.where(raw, spec.raw_width, b).expand(n_groups, -1)
    pos = torch.where(sparse, group_bit + length + rank * width, group_bit + j * width)
    needed = valid & (~sparse | nonzero)
    code = _read_bits(payload, pos, torch.where(needed, width, 0))

    q = code + buffers["qmin"].long()[:, None]
    values = (q.double() * buffers["step"].double()[:, None]).float()
    values = values.masked_fill(sparse & ~nonzero, 0.0)
    # Raw codes are the input dtype's bits: reinterpret them (two's complement first).
    signed = code - ((code >> (spec.raw_width - 1)) << spec.raw_width)
    raw_values = signed.to(spec.raw_int).view(spec.dtype).float()
    return torch.where(raw, raw_values, values).reshape(-1)[:n]
