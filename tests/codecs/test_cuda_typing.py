"""The CUDA kernels type-check and lower for a real GPU, without one.

The simulator runs kernels as Python, so it cannot catch a Numba-CUDA typing error that
would only appear when compiling for a device. Here a subprocess (the test session itself
runs under the simulator) types the kernels with the real Numba-CUDA front end and lowers
them to LLVM IR for compute capability 9.0; only NVVM (the PTX step, which needs the CUDA
libraries) is skipped. ``compile_device`` asks the driver for the current device's compute
capability, so that one call is answered with 9.0.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

_SCRIPT = textwrap.dedent(
    """
    import sys, types as pytypes
    try:
        from numba import types
        from numba.cuda import dispatcher
        from numba.cuda.compiler import compile_cuda
    except ImportError as exc:
        print(f"numba-cuda internals moved: {exc}"); sys.exit(3)
    if not hasattr(dispatcher, "get_current_device"):
        print("numba-cuda internals moved: dispatcher.get_current_device"); sys.exit(3)
    dispatcher.get_current_device = lambda: pytypes.SimpleNamespace(compute_capability=(9, 0))
    from memctl.codecs.lossless import _cuda as _lossless_cuda
    from memctl.codecs.quantize import _cuda as _quantize_cuda

    f32, u8 = types.Array(types.float32, 1, "C"), types.Array(types.uint8, 1, "C")
    meta, i32, i64 = types.Array(types.float32, 2, "C"), types.Array(types.int32, 1, "C"), types.int64
    kernels = [
        (_quantize_cuda.encode, (f32, i64, i64, i64, i64, meta, u8, i32)),
        (_quantize_cuda.decode, (u8, meta, i64, i64, i64, f32, u8, types.boolean, types.float32)),
        (_lossless_cuda.pack, (u8, i64, u8)),
        (_lossless_cuda.unpack, (u8, i64, u8)),
    ]
    for kernel, sig in kernels:
        cres = compile_cuda(kernel.py_func, types.void, sig, fastmath=False, cc=(9, 0))
        ir = cres.library.get_llvm_str()
        assert " fast " not in ir and "contract" not in ir, "fast-math flags in " + kernel.py_func.__name__
        print("ok", kernel.py_func.__name__)

    # quantize's warp-team kernels, one pair per (bits, values per lane) that the codec builds
    from memctl.codecs.quantize import _cuda_teams
    b1 = types.boolean
    for bits, chunk in [(1, 16), (2, 16), (1, 8), (2, 8), (4, 8), (8, 8)]:
        enc, dec = _cuda_teams.team_kernels(bits, chunk, False)
        bound = (_cuda_teams.TEAM_TPB, _cuda_teams.BLOCKS_PER_SM)
        assert enc.targetoptions["launch_bounds"] == dec.targetoptions["launch_bounds"] == bound
        sigs = [
            (enc, (f32, i64, i64, i64, meta, u8, i32, u8, b1)),
            (dec, (u8, meta, i64, i64, f32, u8, b1, types.float32)),
        ]
        for kernel, sig in sigs:
            cres = compile_cuda(kernel.py_func, types.void, sig, fastmath=False, cc=(9, 0))
            ir = cres.library.get_llvm_str()
            assert " fast " not in ir and "contract" not in ir, f"fast-math flags in teams{bits}x{chunk}"
        print("ok", f"teams{bits}x{chunk}")

    # errorbound: its per-group steps, compiled for CUDA from the shared source
    from numba import cuda
    from memctl.codecs.errorbound._ops import make_group_ops
    ops = make_group_ops(cuda.jit(device=True, fastmath=False))
    f64, i16, i64a = types.float64, types.Array(types.int16, 1, "C"), types.Array(types.int64, 1, "C")
    groups = (u8, i32, f32)
    steps = [
        (ops.plan, (f32, i64, i64, i64, f64, f64, f64, f64, f64, i64, *groups, i64a)),
        (ops.pack, (f32, i16, i64, i64, i64, i64, *groups, i64a, u8)),
        (ops.unpack_value, (u8, i64, i64, i64, i64, i64, *groups, i64a, f32)),
    ]
    for step, sig in steps:
        cres = compile_cuda(step.py_func, types.void, sig, fastmath=False, cc=(9, 0))
        ir = cres.library.get_llvm_str()
        assert " fast " not in ir and "contract" not in ir, "fast-math flags in " + step.py_func.__name__
        print("ok", step.py_func.__name__)
    """
)


def test_cuda_kernels_type_check_for_a_real_device() -> None:
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0"}
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=300, env=env
    )
    if out.returncode == 3:
        pytest.skip(out.stdout.strip())
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == [
        "ok", "encode", "ok", "decode", "ok", "pack", "ok", "unpack",
        "ok", "teams1x16", "ok", "teams2x16", "ok", "teams1x8",
        "ok", "teams2x8", "ok", "teams4x8", "ok", "teams8x8",
        "ok", "plan", "ok", "pack", "ok", "unpack_value",
    ]
