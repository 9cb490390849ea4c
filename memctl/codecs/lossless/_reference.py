"""PyTorch reference of the ``lossless`` codec's bit-packing: the specification its kernels match.

The Numba CPU kernels (:mod:`memctl.codecs.lossless._kernels`) and the CUDA kernels
(:mod:`memctl.codecs.lossless._cuda`) write the same bytes.
"""

from __future__ import annotations

import torch

__all__ = ["pack", "two_valued", "unpack"]

_BIT_WEIGHTS = (1, 2, 4, 8, 16, 32, 64, 128)


def pack(mask: torch.Tensor) -> torch.Tensor:
    """Readable PyTorch bit-packing of a 1-D bool tensor."""
    n = mask.numel()
    padded = torch.zeros(-(-n // 8) * 8, dtype=torch.uint8, device=mask.device)
    padded[:n] = mask.to(torch.uint8)
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.int32, device=mask.device)
    return (padded.reshape(-1, 8).to(torch.int32) * weights).sum(dim=1).to(torch.uint8)


def unpack(payload: torch.Tensor, n: int) -> torch.Tensor:
    """Readable PyTorch unpacking: the first ``n`` bits of ``payload`` as bools."""
    shifts = torch.arange(8, dtype=torch.int32, device=payload.device)
    bits = (payload.to(torch.int32)[:, None] >> shifts) & 1
    return bits.reshape(-1)[:n].to(torch.bool)


def two_valued(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Readable PyTorch form of the CPU kernel ``two_valued_serial``: for ``x`` (a float
    tensor's 1-D integer view), ``(bits of x != x[0], the two values)`` when ``x`` takes at
    most two values, else None."""
    a = x[0]
    differs = x != a
    rest = x[differs]
    b = rest[0] if rest.numel() else a
    if rest.numel() and not bool((rest == b).all()):
        return None
    return pack(differs), torch.stack([a, b])
