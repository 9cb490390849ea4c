"""PyTorch reference of the ``quantize`` codec: the specification its kernels are held to.

Readable, chunked tensor code that writes the record format of
:mod:`memctl.codecs.quantize.codec` byte for byte like the Numba CPU kernel
(:mod:`memctl.codecs.quantize._kernels`) and the CUDA kernel
(:mod:`memctl.codecs.quantize._cuda`); see NOTE [ Quantize arithmetic ] there.
"""

from __future__ import annotations

import torch

from memctl.codecs import _rng

__all__ = ["decode", "encode"]

_REF_CHUNK = 1 << 22  # values per chunk of the reference (bounds its temporaries)


def _padded_groups(flat: torch.Tensor, group: int, fill: float) -> torch.Tensor:
    n = flat.numel()
    ngroups = -(-n // group)
    padded = torch.full((ngroups * group,), fill, dtype=flat.dtype, device=flat.device)
    padded[:n] = flat
    return padded.reshape(ngroups, group)


def _group_minmax(flat: torch.Tensor, group: int) -> torch.Tensor:
    """``meta``: per-group (min, max) over finite values, float32, (0, 0) without any."""
    x = _padded_groups(flat, group, float("nan"))
    finite = torch.isfinite(x)
    inf = torch.tensor(float("inf"), dtype=torch.float32, device=flat.device)
    mn = torch.where(finite, x, inf).amin(dim=1)
    mx = torch.where(finite, x, -inf).amax(dim=1)
    none = mn > mx
    mn = torch.where(none, torch.zeros_like(mn), mn) + 0.0  # + 0.0: -0.0 -> +0.0
    mx = torch.where(none, torch.zeros_like(mx), mx) + 0.0
    return torch.stack([mn, mx], dim=1)


def encode(
    flat: torch.Tensor, bits: int, group: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Readable PyTorch encode (the specification of the kernels): ``(payload, meta)``.

    Works through chunks of whole groups, so its float64 temporaries stay bounded when it
    runs on a GPU as the fallback of NOTE [ CUDA fallback ].
    """
    step = max(1, _REF_CHUNK // group) * group
    parts = [_encode_chunk(flat[s : s + step], s, bits, group, seed) for s in range(0, flat.numel(), step)]
    if not parts:
        return _encode_chunk(flat, 0, bits, group, seed)
    return torch.cat([p for p, _ in parts]), torch.cat([m for _, m in parts])


def _encode_chunk(
    flat: torch.Tensor, start: int, bits: int, group: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode the values ``flat`` that sit at positions ``start...`` of the flattened tensor."""
    big = (1 << bits) - 1
    n = flat.numel()
    meta = _group_minmax(flat, group)
    if n == 0:
        return torch.empty(0, dtype=torch.uint8, device=flat.device), meta
    mn = meta[:, 0].double()
    rng = meta[:, 1].double() - mn
    numerator = torch.full_like(rng, big * 2.0**24)  # a tensor: never divide by a Python scalar
    scale = torch.where(rng > 0, numerator / torch.where(rng > 0, rng, 1.0), 0.0)
    x = _padded_groups(flat, group, 0.0).double()
    finite = torch.isfinite(x)
    d = torch.where(finite, x - mn[:, None], 0.0)
    t = (d * scale[:, None]).to(torch.int64)  # truncation toward zero, t >= 0
    local = torch.arange(x.numel(), dtype=torch.int64, device=flat.device).reshape(x.shape)
    r = _rng.hash_torch(seed, local + start) >> 8
    q = torch.clamp_max((t + r) >> 24, big)
    q = torch.where(finite & (local < n), q, 0)  # non-finite values and padding: code 0
    per = 8 // bits
    shifts = torch.arange(0, 8, bits, dtype=torch.int64, device=flat.device)
    payload = (q.reshape(-1, per) << shifts).sum(dim=1).to(torch.uint8)
    return payload, meta


def decode(
    payload: torch.Tensor, meta: torch.Tensor, bits: int, group: int, n: int,
    mask: torch.Tensor | None = None, floor: float = 0.0,
) -> torch.Tensor:
    """Readable PyTorch decode: the float32 values, 1-D (chunked like the encode).

    With ``mask`` (packed bits, value ``i`` in bit ``i % 8`` of byte ``i // 8``): a value whose
    bit is 0 becomes +0.0, one whose bit is 1 becomes ``max(value, floor)`` (NOTE [ Masked decode ]).
    """
    big = (1 << bits) - 1
    gbytes = group * bits // 8
    chunk = max(1, _REF_CHUNK // group)
    parts = [torch.empty(0, dtype=torch.float32, device=payload.device)]
    for g in range(0, meta.shape[0], chunk):
        m = meta[g : g + chunk]
        shifts = torch.arange(0, 8, bits, dtype=torch.int64, device=payload.device)
        codes = payload[g * gbytes : (g + m.shape[0]) * gbytes].to(torch.int64)
        q = ((codes[:, None] >> shifts) & big).reshape(m.shape[0], group)
        mn32, mx32 = m[:, 0:1], m[:, 1:2]
        mn = mn32.double()
        rng = mx32.double() - mn
        levels = torch.arange(big + 1, dtype=torch.float64, device=payload.device)[None, :]
        divisor = torch.full((m.shape[0], big + 1), float(big), dtype=torch.float64, device=payload.device)
        table = (mn + (levels * rng) / divisor).to(torch.float32)
        table = torch.maximum(torch.minimum(table, mx32), mn32)
        parts.append(torch.gather(table, 1, q).reshape(-1))
    out = torch.cat(parts)[:n]
    if mask is None:
        return out
    index = torch.arange(n, dtype=torch.int64, device=out.device)
    on = ((mask[index >> 3].to(torch.int64) >> (index & 7)) & 1).bool()
    return torch.where(on, torch.clamp_min(out, floor), torch.zeros_like(out))
