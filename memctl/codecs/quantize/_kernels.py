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
Asked for it, the encode also writes the bit mask of ``x > 0`` per group right after
pass (1) (NOTE [ Positive mask in encode ] in the codec module). A masked decode raises
the group's level table to the floor and then clears the values off the mask with an
integer AND (``bits & -(bit)``): a branch on the mask bits, which a ReLU output makes as
unpredictable as coin flips, cost ~8 ns a value (19 ms for a 2.4M-value tensor at one
thread, against 1.6 ms now; the unmasked decode takes ~1 ms).

NOTE [ Quantize CUDA kernels ]
The first kernels gave each group of 256 values a block of 64 threads: 1 KiB of work behind
a chain of dependent loads and eight block barriers, a second read of the values from
global memory, 64-bit integer and float64 arithmetic per value, and a float64 division per
level in decode. Per-block latency, not bandwidth, set their speed (an H200 encoded 2-bit
codes at 0.14 of its copy bandwidth). The kernels of ``_cuda_teams`` work in warps instead:

- A warp takes a *tile* of whole groups, ``32 * C`` values at most, with ``C`` values per
  lane (16 at 1 and 2 bits when the group is a multiple of 16, else 8, so a lane's run never
  crosses a group). A group is held by a *team* of ``G / C`` consecutive lanes, so a warp
  holds ``32 // (G / C)`` groups (32 groups of 8, two of 256 at ``C = 16``). ``C`` and the
  bit width are compile-time constants (one kernel per pair, built on first use), so the
  loops over a lane's values unroll and the values stay in registers.
- Loads are coalesced (lane ``l`` reads values ``32 j + l``) into a per-warp shared tile
  padded by one word per 32, from which each lane reads its own ``C`` consecutive values
  without bank conflicts. Encode issues the next tile's loads before coding the current
  one, so they are in flight during the arithmetic.
- A team's min/max is a tree over its lanes in shared memory (at most five steps); groups
  are read once, and codes are computed from registers with the group's constants hoisted
  (``mn64``; the scale ``B * 2**24 / R``, one float64 division per lane and tile, none per
  value; the hash key) and one ``lowbias32`` per value. Packed bytes go through shared
  memory again so that each store instruction writes 32 consecutive bytes. Asked for it,
  the encode also writes the ``x > 0`` bit mask (NOTE [ Positive mask in encode ]).
- Decode computes the 2 or 4 levels of a group once per lane (1 and 2 bits) or each value's
  level with the reference's expression (4 and 8 bits, where a table would cost as many
  divisions as the values), applies the mask and floor (NOTE [ Masked decode ]), and stores
  through the shared tile so consecutive lanes write consecutive floats. It needs no
  reduction, so its only barriers guard the shared tile; a tile's metadata, payload and mask
  bytes are loaded one iteration ahead, while the previous tile is being stored.
- On a GPU the hash runs on 32-bit multiplies (products truncated to 32 bits); the masked
  64-bit form that the simulator runs (its NumPy scalars warn on overflow) stays in 64-bit
  registers after NVVM. The same function of the index, tested against ``lowbias32``.
- Barriers are per warp (``syncwarp``). Numba's simulator has no ``syncwarp`` (nor warp
  shuffles), so there the kernels are built with block barriers; every loop trip count is
  uniform over the block, so both barriers are reached by every thread equally often, and
  warps only share data within their own slice of shared memory.
- The grid is ``BLOCKS_PER_SM`` blocks of 128 threads per multiprocessor (read once per
  device), the launch bound that caps registers so that all of them are resident: the
  grid-stride loop runs in one wave. A small tensor gets a small grid on purpose; Numba's
  under-utilization warning is filtered around that launch only.

Groups larger than a warp's tile (above 512 values at 1 and 2 bits, 256 at 4 and 8) run the
first kernels (``_cuda``): one block of ``TPB`` threads per group, a shared-memory min/max
and one output byte per thread; there the per-group work is large enough to carry the
per-block cost. A thread that saw a non-finite value adds 1 to a counter (one atomic, and a
count that cannot wrap to 0), so the host reads a single int to decide whether to build the
exception list. All kernels run
on PyTorch's current stream with ``fastmath=False``.
"""

from __future__ import annotations

import functools
import warnings
from types import ModuleType
from typing import Any

import numpy as np
import torch

from memctl.codecs import _backend
from memctl.codecs._launch import DirectLaunch

__all__ = [
    "SERIAL_BELOW",
    "cpu_kernels",
    "cuda_kernels",
    "decode_affine_cpu",
    "decode_cpu",
    "decode_cuda",
    "encode_cpu",
    "encode_cuda",
    "square_read_cpu",
    "square_read_segments_cpu",
]

_CHUNKS_PER_THREAD = 16
# Below this many values the serial compilation of the same kernel runs: a parallel launch
# costs tens of microseconds, and far more when the cores are busy with other work.
SERIAL_BELOW = 1 << 16


@functools.cache
def cpu_kernels() -> ModuleType:
    """The module of CPU kernels, :mod:`memctl.codecs.quantize._cpu` (imports Numba).

    The first call in a process compiles the kernels when Numba's cache does not hold them
    yet, and says so in the log (NOTE [ Kernel cache ] in :mod:`memctl.codecs._numba`).
    """
    from numba import types as nt

    from memctl.codecs import _numba
    from memctl.codecs.quantize import _cpu

    f32, u8, i64 = nt.float32[::1], nt.uint8[::1], nt.int64
    meta = nt.float32[:, ::1]
    enc = [(f32, i64, i64, i64, meta, u8, nt.int64[::1], u8, nt.boolean)]
    dec = [(u8, meta, i64, i64, f32, u8, nt.boolean, nt.float32)]
    aff = [(u8, meta, i64, i64, f32, f32, f32, f32, i64, u8, nt.boolean, nt.float32)]
    sq = [(f32, meta, i64, i64, nt.float32, i64, f32)]
    seg = [(f32, meta, i64, i64, nt.int64[::1], nt.int64[::1], f32, f32)]
    _numba.prepare(
        "quantize",
        [(_cpu.encode, enc), (_cpu.encode_serial, enc), (_cpu.decode, dec), (_cpu.decode_serial, dec),
         (_cpu.decode_affine, aff), (_cpu.decode_affine_serial, aff), (_cpu.square_read_serial, sq),
         (_cpu.square_read_segments, seg)],
    )
    return _cpu


_NO_MASK = np.zeros(1, dtype=np.uint8)


def _chunks(ngroups: int, threads: int) -> int:
    return max(1, min(ngroups, threads * _CHUNKS_PER_THREAD))


def encode_cpu(
    x: torch.Tensor, bits: int, group: int, seed: int, positive: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Encode a contiguous 1-D float32 CPU tensor: ``(payload, meta, groups with non-finite)``.

    ``positive``: ``ceil(n / 8)`` uint8 that receive the bit mask of ``x > 0`` in the same
    pass (NOTE [ Positive mask in encode ] in the codec module). ``out``: the payload
    (``ngroups * group * bits / 8`` uint8) and meta (``[ngroups, 2]`` float32) to write, both
    contiguous (NOTE [ Batched small records ] in ``memctl/controller/batches.py``).
    """
    n = x.numel()
    ngroups = -(-n // group)
    if out is None:
        payload = torch.empty(ngroups * group * bits // 8, dtype=torch.uint8)
        meta = torch.empty((ngroups, 2), dtype=torch.float32)
    else:
        payload, meta = out
    if n == 0:
        return payload, meta, 0
    k = cpu_kernels()
    mask = (_NO_MASK, False) if positive is None else (positive.numpy(), True)
    args = (x.numpy(), group, bits, seed, meta.numpy(), payload.numpy())
    if n < SERIAL_BELOW:
        bad = np.zeros(1, dtype=np.int64)
        k.encode_serial(*args, bad, *mask)
        return payload, meta, int(bad[0])
    from memctl.codecs import _numba

    bad = np.zeros(_chunks(ngroups, _numba.threads()), dtype=np.int64)
    _numba.launch(k.encode, k.encode_serial, *args, bad, *mask)
    return payload, meta, int(bad.sum())


def decode_cpu(
    payload: torch.Tensor, meta: torch.Tensor, bits: int, group: int, n: int,
    mask: torch.Tensor | None = None, floor: float = 0.0,
) -> torch.Tensor:
    """The float32 values (1-D, ``n`` of them) of a record's payload and metadata, on the CPU.

    ``mask``: packed bits (``ceil(n / 8)`` uint8) applied as in NOTE [ Masked decode ] with ``floor``.
    """
    out = torch.empty(n, dtype=torch.float32)
    if n:
        k = cpu_kernels()
        bits_arr = _NO_MASK if mask is None else mask.numpy()
        args = (payload.numpy(), meta.numpy(), group, bits, out.numpy(), bits_arr, mask is not None,
                np.float32(floor))
        if n < SERIAL_BELOW:
            k.decode_serial(*args)
        else:
            from memctl.codecs import _numba

            _numba.launch(k.decode, k.decode_serial, *args)
    return out


def decode_affine_cpu(
    payload: torch.Tensor, meta: torch.Tensor, bits: int, group: int, n: int, sub: torch.Tensor,
    scale: torch.Tensor, shift: torch.Tensor, inner: int, mask: torch.Tensor | None = None,
    floor: float = 0.0,
) -> torch.Tensor:
    """:func:`decode_cpu` through a per-channel map (contiguous float32 CPU vectors of the
    channels; blocks of ``inner`` values, block ``k`` is channel ``k % C``): the values
    ``memctl.codecs.channels.affine`` gives on the decoded tensor, in one pass."""
    out = torch.empty(n, dtype=torch.float32)
    if n:
        k = cpu_kernels()
        bits_arr = _NO_MASK if mask is None else mask.numpy()
        args = (payload.numpy(), meta.numpy(), group, bits, out.numpy(), sub.numpy(), scale.numpy(),
                shift.numpy(), inner, bits_arr, mask is not None, np.float32(floor))
        if n < SERIAL_BELOW:
            k.decode_affine_serial(*args)
        else:
            from memctl.codecs import _numba

            _numba.launch(k.decode_affine, k.decode_affine_serial, *args)
    return out


def square_read_cpu(values: torch.Tensor, meta: Any, bits: int, group: int,
                    center: float, offset: int = 0) -> torch.Tensor:
    """NOTE [ Squares of a rounded result ] in memctl/controller/squares.py, in one pass over
    ``values`` (a contiguous float32 CPU tensor, the decode of a record whose group ranges are
    the float32 array ``meta``, starting ``offset`` values into its first group). NumPy around
    the kernel: a recurrent net reads hundreds of small records a step this way, and each
    PyTorch call costs a microsecond or two."""
    vals = values.numpy()
    out = np.empty_like(vals)
    if vals.size:
        cpu_kernels().square_read_serial(vals.reshape(-1), meta, group, bits, np.float32(center), offset,
                                         out.reshape(-1))
    return torch.from_numpy(out)


def square_read_segments_cpu(values: torch.Tensor, meta: Any, bits: int, group: int,
                             segments: list[tuple[int, int, float]]) -> torch.Tensor:
    """:func:`square_read_cpu` of each ``(start, stop, center)`` segment of a batch's values (a
    contiguous float32 CPU tensor whose group ranges are ``meta``), in one call: a tensor of
    ``values``' size whose values outside every segment are undefined."""
    vals = values.numpy().reshape(-1)
    out = np.empty_like(vals)
    if segments:
        starts = np.array([s[0] for s in segments], dtype=np.int64)
        ends = np.array([s[1] for s in segments], dtype=np.int64)
        centers = np.array([s[2] for s in segments], dtype=np.float32)
        cpu_kernels().square_read_segments(vals, meta, group, bits, starts, ends, centers, out)
    return torch.from_numpy(out)


def cuda_kernels() -> Any:
    """The module of CUDA kernels (imports ``numba.cuda``; kernels compile on first launch)."""
    _backend.cuda()  # a CudaUnavailableError with the fix if numba.cuda cannot be imported
    from memctl.codecs.quantize import _cuda as _quantize_cuda

    return _quantize_cuda


@functools.lru_cache(maxsize=64)
def _team_kernels(bits: int, group: int) -> tuple[Any, Any] | None:
    """The warp-team ``(encode, decode)`` for ``group`` (NOTE [ Quantize CUDA kernels ]), or
    None when a group is larger than one warp's tile and the block-per-group kernels run.
    Looked up once per width and group (an encode or decode on a GPU is a few µs of Python
    beside its kernel: each import and lookup here was one of them)."""
    _backend.cuda()
    from memctl.codecs.quantize import _cuda_teams

    if not _cuda_teams.uses_teams(group, bits):
        return None
    return _cuda_teams.team_kernels(bits, _cuda_teams.chunk_for(group, bits), _backend.cuda_simulated())


@functools.lru_cache(maxsize=64)
def _team_shape(group: int, bits: int) -> tuple[int, int, int, int]:
    """``(groups per warp tile, warps per block, blocks per multiprocessor, threads per block)``."""
    from memctl.codecs.quantize import _cuda_teams

    per_tile = 32 // (group // _cuda_teams.chunk_for(group, bits))
    return per_tile, _cuda_teams.WARPS_PER_BLOCK, _cuda_teams.BLOCKS_PER_SM, _cuda_teams.TEAM_TPB


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    """The multiprocessor count of ``device``, read once per device (1 in the simulator)."""
    if device.type != "cuda":
        return 1
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def _team_grid(ngroups: int, group: int, bits: int, device: torch.device) -> int:
    """Blocks for the team kernels: enough for every warp tile, at most one resident wave."""
    per_tile, warps, per_sm, _ = _team_shape(group, bits)
    tiles = -(-ngroups // per_tile)
    blocks = -(-tiles // warps)
    return max(1, min(blocks, _multiprocessors(device) * per_sm))


def _configure(kernel: Any, grid: int, block: int, stream: Any) -> Any:
    """``kernel[grid, block, stream]`` without Numba's "Grid size N will likely result in GPU
    under-utilization" warning: a small tensor gets a small grid on purpose."""
    from numba.core.errors import NumbaPerformanceWarning

    with warnings.catch_warnings():
        # the message may start with terminal highlighting codes (Numba's warning classes add them)
        warnings.filterwarnings("ignore", message=".*Grid size", category=NumbaPerformanceWarning)
        return kernel[grid, block, stream]


def _grid(ngroups: int) -> int:
    return max(1, min(ngroups, 65535 * 16))


def encode_cuda(
    x: torch.Tensor, bits: int, group: int, seed: int, positive: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, int | torch.Tensor]:
    """Encode a contiguous 1-D float32 tensor with the CUDA kernel: ``(payload, meta, flag)``, the
    flag non-zero when some value is non-finite (the number of threads that saw one). On a GPU
    the flag is the one-value int32 tensor the kernel writes, not read here (NOTE [ Exception
    lists without a wait ] in ``_pending``); in the simulator it is an int.

    On a real GPU ``x`` is a CUDA tensor and the outputs stay on its device; in the simulator
    (NOTE [ CUDA simulator ]) a CPU tensor is accepted and the outputs are CPU tensors.
    ``positive``: ``ceil(n / 8)`` uint8 on ``x``'s device that receive the bit mask of ``x > 0``
    (NOTE [ Positive mask in encode ]); the team kernels write it in the same pass.
    """
    dev = x.device
    n = x.numel()
    ngroups = -(-n // group)
    payload = torch.empty(ngroups * group * bits // 8, dtype=torch.uint8, device=dev)
    meta = torch.empty((ngroups, 2), dtype=torch.float32, device=dev)
    if n == 0:
        return payload, meta, 0
    if dev.type == "cuda":  # a slot of the flags' slab (NOTE [ Exception lists without a wait ] in _pending)
        from memctl.codecs.quantize import _pending

        bad = _pending.flag_slot(dev)
    else:
        bad = torch.zeros(1, dtype=torch.int32, device=dev)
    teams = _team_kernels(bits, group)
    if teams is not None:
        mask = _placeholder(dev) if positive is None else positive
        _direct(teams[0])(_team_grid(ngroups, group, bits, dev), _team_shape(group, bits)[3], dev,
                          x, n, group, seed, meta, payload, bad, mask, positive is not None)
    else:
        k = cuda_kernels()
        _direct(k.encode)(_grid(ngroups), k.TPB, dev, x, n, group, bits, seed, meta, payload, bad)
        if positive is not None:
            from memctl.codecs.lossless import _reference as _lossless_reference

            positive.copy_(_lossless_reference.pack(x > 0))
    if bad.is_cuda:  # read later, without waiting (NOTE [ Exception lists without a wait ] in _pending)
        return payload, meta, bad
    return payload, meta, int(bad.item())


def decode_cuda(
    payload: torch.Tensor, meta: torch.Tensor, bits: int, group: int, n: int,
    mask: torch.Tensor | None = None, floor: float = 0.0,
) -> torch.Tensor:
    """The float32 values (1-D, ``n`` of them) of a record, decoded by the CUDA kernel (``mask``
    as in :func:`decode_cpu`)."""
    dev = payload.device
    out = torch.empty(n, dtype=torch.float32, device=dev)
    if n == 0:
        return out
    bits_arr = _placeholder(dev) if mask is None else mask
    tail = (out, bits_arr, mask is not None, np.float32(floor))
    teams = _team_kernels(bits, group)
    if teams is not None:
        _direct(teams[1])(_team_grid(meta.shape[0], group, bits, dev), _team_shape(group, bits)[3], dev,
                          payload, meta, n, group, *tail)
    else:
        k = cuda_kernels()
        _direct(k.decode)(_grid(meta.shape[0]), k.TPB, dev, payload, meta, n, group, bits, *tail)
    return out


# -- launches: directly on the tensors on a GPU (NOTE [ Direct kernel launch ]) ------------------
@functools.lru_cache(maxsize=64)
def _direct(kernel: Any) -> DirectLaunch:
    return DirectLaunch(kernel, "quantize", _configure)


@functools.cache
def _placeholder(device: torch.device) -> torch.Tensor:
    """A one-byte buffer for a mask argument a kernel does not read (or write) this time."""
    return torch.zeros(1, dtype=torch.uint8, device=device)
