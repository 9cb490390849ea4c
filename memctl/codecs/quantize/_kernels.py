"""Numba kernels of the ``quantize`` codec: a parallel CPU kernel and CUDA kernels.

The arithmetic is the one documented in :mod:`memctl.codecs.quantize` (module docstring);
the reference there is the specification these kernels match byte for byte. Kernels are
built on first use (``functools.cache``), never at import, so importing this module
imports neither Numba nor ``numba.cuda``.

NOTE [ Quantize CPU kernel ]
``prange`` runs over chunks of whole groups; per group the kernel makes three passes
over values that sit in L1: (1) min/max over finite values on int32 keys ordered like
the floats (``b ^ ((b >> 31) & 0x7fffffff)`` of the bits ``b``; non-finite values are
replaced by neutral keys and flag the group), because integer min/max reductions
vectorise without fast-math while float ones do not; (2) one code per value with the
group's constants hoisted (``mn64``, the scale ``B * 2**24 / R``, the hash key): one
``lowbias32`` and no division per value, into a small scratch array; a flagged group
takes a branchy loop that codes non-finite values 0; (3) packing with the bit width as
a literal so the inner loop unrolls. Loops are zero-based over slices of the group:
indexing the whole array (``x[s + j]``) keeps Numba's negative-index wrap-around in the
loop and stops LLVM's vectoriser. Passes (1) and (2) vectorise (AVX-512 has packed
float64 -> int64 conversion and 64-bit multiplies). Tensors below ``SERIAL_BELOW``
values run the same code compiled without ``parallel`` (a parallel launch costs more
than their work, and much more while other processes keep the cores busy).

NOTE [ Quantize CUDA kernels ]
Encode is one block of ``TPB`` threads per group (grid-stride over groups): the block
reads the group once for a shared-memory min/max reduction (no warp shuffles, so it also
runs in the simulator), then each thread writes whole output bytes (``8 / bits`` values
per byte, consecutive threads on consecutive bytes, so loads and stores are coalesced).
Non-finite values are counted with one atomic per thread that saw any, so the host reads
a single int to decide whether to build the exception list. Decode is one block per
group: the block fills a shared table of the ``2**bits`` levels, then each thread expands
whole bytes. Both run on PyTorch's current stream with ``fastmath=False``.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from memctl.codecs import _backend, _rng

__all__ = [
    "SERIAL_BELOW",
    "cpu_kernels",
    "cuda_kernels",
    "decode_cpu",
    "decode_cuda",
    "encode_cpu",
    "encode_cuda",
]

_CHUNKS_PER_THREAD = 16
# Below this many values the serial compilation of the same kernel runs: a parallel launch
# costs tens of microseconds, and far more when the cores are busy with other work.
SERIAL_BELOW = 1 << 16


@functools.cache
def cpu_kernels() -> SimpleNamespace:
    """The CPU encode/decode kernels (compiled by Numba on their first call)."""
    import numba
    from numba import prange

    lowbias32 = numba.njit(inline="always")(_rng.lowbias32_numba)

    @numba.njit(inline="always")
    def _key(seed: int, hi: int) -> Any:
        m = np.uint64(0xFFFFFFFF)
        return lowbias32(np.uint64(seed) ^ ((np.uint64(hi) * np.uint64(0x9E3779B9)) & m))

    def encode(x: Any, group: Any, bits: Any, seed: Any, meta: Any, payload: Any, bad: Any) -> None:
        n = x.size
        ngroups = meta.shape[0]
        nchunks = bad.size
        big = (1 << bits) - 1
        scale = np.float64(big) * 16777216.0
        gbytes = group * bits // 8
        xi = x.view(np.int32)
        m32 = np.uint64(0xFFFFFFFF)
        for c in prange(nchunks):
            g0 = c * ngroups // nchunks
            g1 = (c + 1) * ngroups // nchunks
            codes = np.zeros(group, np.uint8)
            scratch = np.empty(2, np.int32)
            scratch_f = scratch.view(np.float32)
            nbad = 0
            for g in range(g0, g1):
                s = g * group
                e = min(s + group, n)
                m = e - s
                # Zero-based loops over slices: no negative-index wrap-around, so LLVM vectorises.
                xs = x[s:e]
                bs = xi[s:e]
                # (1) min/max over finite values as integer keys ordered like the floats.
                lo = np.int32(0x7FFFFFFF)
                hi = np.int32(-0x7FFFFFFF - 1)
                amax = np.int32(0)
                for j in range(m):
                    b = bs[j]
                    a = b & np.int32(0x7FFFFFFF)
                    k = b ^ ((b >> np.int32(31)) & np.int32(0x7FFFFFFF))
                    fin = a < np.int32(0x7F800000)
                    klo = k if fin else np.int32(0x7FFFFFFF)
                    khi = k if fin else np.int32(-0x7FFFFFFF - 1)
                    lo = klo if klo < lo else lo
                    hi = khi if khi > hi else hi
                    amax = a if a > amax else amax
                special = amax >= np.int32(0x7F800000)
                nbad += 1 if special else 0
                scratch[0] = lo ^ ((lo >> np.int32(31)) & np.int32(0x7FFFFFFF))
                scratch[1] = hi ^ ((hi >> np.int32(31)) & np.int32(0x7FFFFFFF))
                mn = scratch_f[0]
                mx = scratch_f[1]
                if lo > hi:  # no finite value
                    mn = np.float32(0.0)
                    mx = np.float32(0.0)
                mn = mn + np.float32(0.0)  # -0.0 -> +0.0: one canonical zero
                mx = mx + np.float32(0.0)
                meta[g, 0] = mn
                meta[g, 1] = mx
                # (2) codes
                mn64 = np.float64(mn)
                rng = np.float64(mx) - mn64
                sc = scale / rng if rng > 0.0 else 0.0
                hi32 = s >> 32
                key = _key(seed, hi32)
                if not special and ((e - 1) >> 32) == hi32:
                    for j in range(m):
                        t = np.int64((np.float64(xs[j]) - mn64) * sc)
                        r = np.int64(lowbias32((np.uint64(s + j) & m32) ^ key) >> np.uint64(8))
                        codes[j] = min((t + r) >> 24, big)
                else:
                    for j in range(m):
                        v = xs[j]
                        q = 0
                        if abs(v) <= np.float32(3.4028234663852886e38):
                            i = s + j
                            kk = key if (i >> 32) == hi32 else _key(seed, i >> 32)
                            t = np.int64((np.float64(v) - mn64) * sc)
                            r = np.int64(lowbias32((np.uint64(i) & m32) ^ kk) >> np.uint64(8))
                            q = min((t + r) >> 24, big)
                        codes[j] = q
                for j in range(m, group):
                    codes[j] = 0
                # (3) packing, little-endian within a byte
                out = payload[g * gbytes : (g + 1) * gbytes]
                if bits == 2:
                    for k in range(gbytes):
                        out[k] = (
                            codes[4 * k]
                            | (codes[4 * k + 1] << 2)
                            | (codes[4 * k + 2] << 4)
                            | (codes[4 * k + 3] << 6)
                        )
                elif bits == 1:
                    for k in range(gbytes):
                        out[k] = (
                            codes[8 * k]
                            | (codes[8 * k + 1] << 1)
                            | (codes[8 * k + 2] << 2)
                            | (codes[8 * k + 3] << 3)
                            | (codes[8 * k + 4] << 4)
                            | (codes[8 * k + 5] << 5)
                            | (codes[8 * k + 6] << 6)
                            | (codes[8 * k + 7] << 7)
                        )
                elif bits == 4:
                    for k in range(gbytes):
                        out[k] = codes[2 * k] | (codes[2 * k + 1] << 4)
                else:
                    for k in range(gbytes):
                        out[k] = codes[k]
            bad[c] = nbad

    def decode(payload: Any, meta: Any, group: Any, bits: Any, out: Any) -> None:
        n = out.size
        ngroups = meta.shape[0]
        nchunks = min(ngroups, 256)
        big = (1 << bits) - 1
        gbytes = group * bits // 8
        for c in prange(nchunks):
            g0 = c * ngroups // nchunks
            g1 = (c + 1) * ngroups // nchunks
            lv = np.empty(big + 1, np.float32)
            for g in range(g0, g1):
                mn = meta[g, 0]
                mx = meta[g, 1]
                mn64 = np.float64(mn)
                rng = np.float64(mx) - mn64
                for q in range(big + 1):
                    y = np.float32(mn64 + (np.float64(q) * rng) / np.float64(big))
                    y = mn if y < mn else y
                    y = mx if y > mx else y
                    lv[q] = y
                s = g * group
                e = min(s + group, n)
                m = e - s
                ps = payload[g * gbytes : (g + 1) * gbytes]
                os = out[s:e]
                if m == group and bits == 2:
                    for k in range(gbytes):
                        b = ps[k]
                        os[4 * k] = lv[b & 3]
                        os[4 * k + 1] = lv[(b >> 2) & 3]
                        os[4 * k + 2] = lv[(b >> 4) & 3]
                        os[4 * k + 3] = lv[b >> 6]
                elif m == group and bits == 1:
                    for k in range(gbytes):
                        b = ps[k]
                        for j in range(8):
                            os[8 * k + j] = lv[(b >> j) & 1]
                elif m == group and bits == 4:
                    for k in range(gbytes):
                        b = ps[k]
                        os[2 * k] = lv[b & 15]
                        os[2 * k + 1] = lv[b >> 4]
                elif bits == 8:
                    for j in range(m):
                        os[j] = lv[ps[j]]
                else:
                    for j in range(m):
                        os[j] = lv[(ps[(j * bits) >> 3] >> ((j * bits) & 7)) & big]

    parallel = numba.njit(parallel=True, cache=False, fastmath=False, nogil=True)
    serial = numba.njit(parallel=False, cache=False, fastmath=False, nogil=True)  # prange runs as range
    return SimpleNamespace(
        encode=parallel(encode),
        decode=parallel(decode),
        encode_serial=serial(encode),
        decode_serial=serial(decode),
    )


def _chunks(ngroups: int) -> int:
    import numba

    return max(1, min(ngroups, numba.get_num_threads() * _CHUNKS_PER_THREAD))


def encode_cpu(
    x: torch.Tensor, bits: int, group: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Encode a contiguous 1-D float32 CPU tensor: ``(payload, meta, groups with non-finite)``."""
    n = x.numel()
    ngroups = -(-n // group)
    payload = torch.empty(ngroups * group * bits // 8, dtype=torch.uint8)
    meta = torch.empty((ngroups, 2), dtype=torch.float32)
    if n == 0:
        return payload, meta, 0
    k = cpu_kernels()
    kernel = k.encode_serial if n < SERIAL_BELOW else k.encode
    bad = np.zeros(1 if n < SERIAL_BELOW else _chunks(ngroups), dtype=np.int64)
    kernel(x.numpy(), group, bits, seed, meta.numpy(), payload.numpy(), bad)
    return payload, meta, int(bad.sum())


def decode_cpu(payload: torch.Tensor, meta: torch.Tensor, bits: int, group: int, n: int) -> torch.Tensor:
    """The float32 values (1-D, ``n`` of them) of a record's payload and metadata, on the CPU."""
    out = torch.empty(n, dtype=torch.float32)
    if n:
        k = cpu_kernels()
        kernel = k.decode_serial if n < SERIAL_BELOW else k.decode
        kernel(payload.numpy(), meta.numpy(), group, bits, out.numpy())
    return out


def cuda_kernels() -> Any:
    """The module of CUDA kernels (imports ``numba.cuda``; kernels compile on first launch)."""
    _backend.cuda()  # a CudaUnavailableError with the fix if numba.cuda cannot be imported
    from memctl.codecs.quantize import _cuda as _quantize_cuda

    return _quantize_cuda


def _grid(ngroups: int) -> int:
    return max(1, min(ngroups, 65535 * 16))


def encode_cuda(
    x: torch.Tensor, bits: int, group: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Encode a contiguous 1-D float32 tensor with the CUDA kernel: ``(payload, meta, non-finite count)``.

    On a real GPU ``x`` is a CUDA tensor and the outputs stay on its device; in the simulator
    (NOTE [ CUDA simulator ]) a CPU tensor is accepted and the outputs are CPU tensors.
    """
    dev = x.device
    n = x.numel()
    ngroups = -(-n // group)
    payload = torch.empty(ngroups * group * bits // 8, dtype=torch.uint8, device=dev)
    meta = torch.empty((ngroups, 2), dtype=torch.float32, device=dev)
    if n == 0:
        return payload, meta, 0
    bad = torch.zeros(1, dtype=torch.int32, device=dev)
    k = cuda_kernels()
    d_payload = _backend.to_device_array(payload)
    d_meta = _backend.to_device_array(meta)
    d_bad = _backend.to_device_array(bad)
    stream = _backend.torch_stream(dev)
    k.encode[_grid(ngroups), k.TPB, stream](
        _backend.to_device_array(x), n, group, bits, seed, d_meta, d_payload, d_bad
    )
    payload = _backend.from_device_array(d_payload, dev)
    meta = _backend.from_device_array(d_meta, dev)
    count = int(_backend.from_device_array(d_bad, dev)[0].item())  # NOTE [ Exception list ]: one sync
    return payload, meta, count


def decode_cuda(payload: torch.Tensor, meta: torch.Tensor, bits: int, group: int, n: int) -> torch.Tensor:
    """The float32 values (1-D, ``n`` of them) of a record, decoded by the CUDA kernel."""
    dev = payload.device
    out = torch.empty(n, dtype=torch.float32, device=dev)
    if n == 0:
        return out
    d_out = _backend.to_device_array(out)
    stream = _backend.torch_stream(dev)
    k = cuda_kernels()
    k.decode[_grid(meta.shape[0]), k.TPB, stream](
        _backend.to_device_array(payload), _backend.to_device_array(meta), n, group, bits, d_out
    )
    return _backend.from_device_array(d_out, dev)
