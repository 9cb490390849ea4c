"""Numba CPU kernels of the ``errorbound`` codec: the loops of :mod:`._ops` compiled for the CPU.

The loops are cached on disk (NOTE [ Kernel cache ] in :mod:`memctl.codecs._numba`, NOTE
[ One source, two targets ] in :mod:`memctl.codecs.errorbound._ops`). This module imports
Numba at its top, so it is imported only on the codec's first CPU use.
"""

from __future__ import annotations

from typing import Any

import numba

from memctl.codecs._numba import cached_jit
from memctl.codecs.errorbound._ops import make_group_ops

__all__ = ["pack", "pack_serial", "plan", "plan_serial", "unpack", "unpack_serial"]


def _loop_jit(parallel: bool) -> Any:
    return cached_jit(parallel=parallel, fastmath=False)


_ops = make_group_ops(numba.njit(fastmath=False), _loop_jit)
plan = _ops.loops["plan_groups"]
pack = _ops.loops["pack_groups"]
unpack = _ops.loops["unpack_groups"]
plan_serial = _ops.loops["plan_serial"]
pack_serial = _ops.loops["pack_serial"]
unpack_serial = _ops.loops["unpack_serial"]
