"""Launching compiled Numba-CUDA kernels on PyTorch tensors without Numba's per-call dispatch.

NOTE [ Direct kernel launch ]
A kernel launched the usual way (``kernel[grid, block, stream](*args)``) costs about 50 µs of
Python in Numba's dispatcher on an H200 machine (numba-cuda 0.30.4), and each tensor turned into
a Numba device array first (``as_cuda_array``) about 19 µs more: an encode with four arrays
spent over 100 µs launching a kernel that runs for a few microseconds, and a CNN step made of
such launches ran 7.7x plain PyTorch. :class:`DirectLaunch` launches the first call of each
argument signature the usual way (Numba compiles there), keeps the compiled kernel, and from
then on lays out the kernel's parameters itself, the way Numba's ``_Kernel.launch`` does: an
array as ``(meminfo, parent, size, itemsize, data, *shape, *strides in bytes)`` with null
meminfo and parent, a scalar as the ctypes value of its Numba type. It reads the pointer,
shape and strides straight from the tensor. Only C-contiguous CUDA tensors and plain scalars
take this path; anything else, Numba's simulator (where the tensors written are copied back,
the kernel having run on copies), and every call after the direct path has
failed once (an internal of numba-cuda that moved, say: it warns once) go through the usual
launch, so a numba-cuda release that changes these internals costs speed, never results. The
GPU tier checks the direct path byte for byte against the usual one.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from memctl.codecs import _backend

__all__ = ["DirectLaunch"]

_SCALARS = (bool, int, float, np.integer, np.floating, np.bool_)


class DirectLaunch:
    """One Numba-CUDA kernel, launched on tensors with the least Python (NOTE [ Direct kernel launch ]).

    Args:
        kernel: a ``numba.cuda.jit`` kernel (not configured with ``[grid, block]``).
        name: for the warning when the direct path fails.
        configure: ``(kernel, grid, block, stream) -> launchable`` for the usual launch (default
            ``kernel[grid, block, stream]``).

    Attributes:
        broken: the direct path failed once; every launch goes through Numba's from then on.
    """

    def __init__(self, kernel: Any, name: str,
                 configure: Callable[[Any, int, int, Any], Any] | None = None) -> None:
        self.kernel = kernel
        self.name = name
        self._configure = configure
        self.broken = False
        self._compiled: dict[tuple[Any, ...], tuple[Any, tuple[_Setter, ...]]] = {}
        self._functions: dict[tuple[int, int], Any] = {}

    def __call__(self, grid: int, block: int, device: torch.device, *args: Any) -> None:
        """Run the kernel on PyTorch's current stream of ``device`` with ``args`` (tensors and scalars)."""
        if self.broken or device.type != "cuda" or _backend.cuda_simulated():  # (read once, cached)
            self._usual(grid, block, device, args)
            return
        key = _signature(args)
        if key is None:
            self._usual(grid, block, device, args)
            return
        entry = self._compiled.get(key)
        try:
            if entry is None:
                self._compiled[key] = self._find(self._usual(grid, block, device, args))
                return
            kernel, setters = entry
            params: list[Any] = []
            for setter, value in zip(setters, args, strict=True):
                setter(value, params)
            self._launch(kernel, grid, block, device, params)
        except Exception as exc:  # an internal of numba-cuda that moved: launch the usual way from now on
            self.broken = True
            warnings.warn(
                f"{self.name!r}: the direct kernel launch failed ({type(exc).__name__}: {exc}); "
                "launching through Numba's dispatcher from now on (same results, more overhead per call)",
                RuntimeWarning,
                stacklevel=2,
            )
            if entry is not None:
                self._usual(grid, block, device, args)

    def _launch(self, kernel: Any, grid: int, block: int, device: torch.device, params: list[Any]) -> None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        function = self._functions.get((id(kernel), index))
        if function is None:
            with torch.cuda.device(index):
                function = self._functions[(id(kernel), index)] = kernel._codelibrary.get_cufunc().kernel
        _core().launch(_core_stream(_backend.stream_handle(index)), _config(grid, block), function, *params)

    def _usual(self, grid: int, block: int, device: torch.device, args: tuple[Any, ...]) -> list[Any]:
        """Launch through Numba's dispatcher; returns the arguments as Numba saw them.

        In the simulator (NOTE [ CUDA simulator ]) a CPU tensor reaches the kernel as a copy, so
        every tensor whose bytes the kernel changed is copied back into it afterwards.
        """
        converted = [_backend.to_device_array(a) if isinstance(a, torch.Tensor) else a for a in args]
        stream = _backend.torch_stream(device)
        if self._configure is None:
            self.kernel[grid, block, stream](*converted)
        else:
            self._configure(self.kernel, grid, block, stream)(*converted)
        if device.type != "cuda":
            for a, arr in zip(args, converted, strict=True):
                if isinstance(a, torch.Tensor):
                    _copy_back(a, _backend.from_device_array(arr, device))
        return converted

    def _find(self, converted: list[Any]) -> tuple[Any, tuple[_Setter, ...]]:
        """The compiled kernel for the arguments of the launch that compiled it, and the setters of
        its parameters (one per argument, chosen once: a launch then only calls them)."""
        types = tuple(self.kernel.typeof_pyval(a) for a in converted)
        kernel = self.kernel.overloads[types]
        return kernel, tuple(_setter(ty) for ty in kernel.argument_types)


def _copy_back(t: torch.Tensor, written: torch.Tensor) -> None:
    """Copy the simulator's result into ``t`` when its bytes differ (an unchanged input keeps its
    version counter, which autograd's in-place checks read)."""
    before = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if not torch.equal(written.reshape(-1).view(torch.uint8), before):
        t.copy_(written.reshape(t.shape))


def _signature(args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """A key that tells apart the argument types Numba would compile for, or None when an argument
    cannot take the direct path."""
    key: list[Any] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.device.type != "cuda" or not a.is_contiguous() or a.dim() == 0:
                return None
            key.append((a.dtype, a.dim()))
        elif isinstance(a, _SCALARS):
            key.append(type(a))
        else:
            return None
    return tuple(key)


_Setter = Callable[[Any, list[Any]], None]


def _array(value: Any, out: list[Any]) -> None:
    itemsize = value.element_size()
    strides = [itemsize * s for s in value.stride()]
    out += [0, 0, value.numel(), itemsize, value.data_ptr(), *value.shape, *strides]


def _setter(ty: Any) -> _Setter:
    """The function appending the kernel parameters of an argument of Numba type ``ty``, laid out as
    Numba's ``_Kernel._prepare_args`` lays them out."""
    types = importlib.import_module("numba.cuda.types")
    if isinstance(ty, types.Array):
        return _array
    if isinstance(ty, types.Integer):
        ctype = getattr(ctypes, f"c_{ty}")
        return lambda value, out: out.append(ctype(int(value)))
    if ty == types.float32:
        return lambda value, out: out.append(ctypes.c_float(float(value)))
    if ty == types.float64:
        return lambda value, out: out.append(ctypes.c_double(float(value)))
    if ty == types.boolean:
        return lambda value, out: out.append(bool(value))
    raise TypeError(f"no direct layout for a kernel argument of type {ty}")


@functools.cache
def _core() -> Any:
    """The ``cuda.core`` module, imported on the first direct launch."""
    return importlib.import_module("cuda.core")


@functools.lru_cache(maxsize=64)
def _core_stream(handle: int) -> Any:
    """``cuda.core``'s stream over the CUDA stream ``handle``, made once per handle (it owns nothing)."""
    driver = importlib.import_module("numba.cuda.cudadrv.driver")
    return driver._to_core_stream(_backend.torch_stream_of_handle(handle))


@functools.lru_cache(maxsize=256)
def _config(grid: int, block: int) -> Any:
    launch_config = _core().LaunchConfig
    if importlib.import_module("numba.cuda._compat").CUDA_CORE_GE_1_0:
        return launch_config(grid=grid, block=block, shmem_size=0, is_cooperative=False)
    return launch_config(grid=grid, block=block, shmem_size=0, cooperative_launch=False)
