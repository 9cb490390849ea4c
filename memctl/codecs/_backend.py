"""Capability checks and glue between PyTorch tensors and Numba kernels.

Nothing here imports ``numba.cuda`` or touches a device until a function is called,
so ``import memctl`` stays free of CUDA initialisation and JIT compilation.

NOTE [ CUDA simulator ]
With ``NUMBA_ENABLE_CUDASIM=1`` (set before ``numba.cuda`` is first imported) Numba runs
CUDA kernels in a Python simulator: bit-exact, about 400 values/s, no
``as_cuda_array``. There the CUDA implementation accepts CPU tensors and copies them
into simulated device arrays, which is how the CPU-only tiers test the CUDA kernels.
"""

from __future__ import annotations

import functools
import importlib
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar

import torch

from memctl.codecs.base import Impl
from memctl.errors import CodecError, CudaUnavailableError

__all__ = [
    "CUDA_EXTRA_HINT",
    "CudaFallback",
    "cuda",
    "cuda_kernels_available",
    "cuda_simulated",
    "from_device_array",
    "is_cuda_compile_error",
    "require_tensor",
    "resolve_impl",
    "to_device_array",
    "torch_stream",
    "warn_cuda_fallback",
]

CUDA_EXTRA_HINT = (
    "compiling Numba-CUDA kernels for a real GPU needs the CUDA compiler libraries: "
    "install memctl with the extra matching your driver, `pip install 'memctl[cuda12]'` "
    "or `pip install 'memctl[cuda13]'`"
)


@functools.cache
def cuda() -> ModuleType:
    """The ``numba.cuda`` module, imported on first use."""
    try:
        return importlib.import_module("numba.cuda")
    except Exception as exc:  # pragma: no cover - numba-cuda is a dependency
        raise CudaUnavailableError(f"numba.cuda could not be imported ({exc}); {CUDA_EXTRA_HINT}") from exc


@functools.cache
def cuda_simulated() -> bool:
    """True when Numba's CUDA simulator is active (see NOTE [ CUDA simulator ]); read once (Numba
    reads ``NUMBA_ENABLE_CUDASIM`` when it is imported)."""
    try:
        from numba.cuda import config as cuda_config
    except Exception:  # pragma: no cover
        return False
    return bool(cuda_config.ENABLE_CUDASIM)  # type: ignore[attr-defined]


def cuda_kernels_available() -> bool:
    """True when CUDA kernels can run: a real device, or the simulator."""
    try:
        return bool(cuda().is_available())
    except Exception:
        return False


def resolve_impl(impl: Impl | str | None, t_device: torch.device) -> Impl:
    """The implementation to run for data on ``t_device``; validates ``impl``."""
    if impl is None:
        return Impl.CUDA if t_device.type == "cuda" else Impl.CPU
    try:
        chosen = Impl(impl)
    except ValueError:
        allowed = ", ".join(repr(i.value) for i in Impl)
        raise CodecError(f"impl={impl!r} is not one of {allowed} (or None for automatic)") from None
    if chosen is Impl.CPU and t_device.type != "cpu":
        raise CodecError(
            f"impl='cpu' needs a CPU tensor, got one on {t_device}; move it with .cpu() "
            "or use impl='cuda'"
        )
    if chosen is Impl.CUDA and t_device.type != "cuda" and not cuda_simulated():
        raise CodecError(
            f"impl='cuda' needs a CUDA tensor, got one on {t_device}; move it with .cuda() "
            "or set NUMBA_ENABLE_CUDASIM=1 to run the kernels in Numba's simulator"
        )
    return chosen


def to_device_array(t: torch.Tensor) -> Any:
    """A Numba device array over ``t`` (contiguous).

    On a real GPU this is a zero-copy view through ``__cuda_array_interface__``; in the
    simulator a CPU tensor is copied into a simulated device array.
    """
    if t.device.type == "cuda":
        # sync=False: kernels run on PyTorch's current stream, which orders them after
        # whatever produced ``t``; a device-wide sync per buffer would only cost time.
        return cuda().as_cuda_array(t.detach(), sync=False)
    return cuda().to_device(t.detach().contiguous().numpy())


def from_device_array(arr: Any, device: torch.device) -> torch.Tensor:
    """A tensor on ``device`` holding ``arr`` (zero-copy on a real GPU)."""
    if device.type == "cuda":
        return torch.as_tensor(arr, device=device)
    return torch.from_numpy(arr.copy_to_host())


def current_stream_handle(device: torch.device) -> int:
    """The CUDA handle of PyTorch's current stream on ``device``: ``torch.cuda.current_stream``
    makes a Python stream object each call (~5 µs on an H200 machine, once per kernel launch);
    the raw handle is one C call where PyTorch offers it (CUDA builds)."""
    return stream_handle(device.index if device.index is not None else torch.cuda.current_device())


def stream_handle(index: int) -> int:
    """:func:`current_stream_handle` of the CUDA device of index ``index``."""
    if _RAW_STREAM is not None:
        return int(_RAW_STREAM(index))
    return int(torch.cuda.current_stream(index).cuda_stream)


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def torch_stream(device: torch.device) -> Any:
    """PyTorch's current stream on ``device`` as a Numba stream (0, the default, in the simulator)."""
    if device.type != "cuda":
        return 0
    return torch_stream_of_handle(torch.cuda.current_stream(device).cuda_stream)


@functools.lru_cache(maxsize=64)
def torch_stream_of_handle(handle: int) -> Any:
    """A Numba stream over the CUDA stream ``handle``, made once per handle: making one took
    17 µs per launch on an H200 machine. It owns nothing (PyTorch's streams live as long as
    the process), so a handle reused by a later stream is still that stream."""
    return cuda().external_stream(handle)


def is_cuda_compile_error(exc: BaseException) -> bool:
    """True when ``exc`` says the CUDA kernels cannot be built here, so the reference must run.

    NOTE [ CUDA fallback ]
    Plain ``numba-cuda`` runs kernels in the simulator but cannot compile them for a real
    GPU without its ``cu12``/``cu13`` extra (or a CUDA toolkit). Nor can a ``numba-cuda``
    that breaks on the installed NumPy: numba-cuda 0.30.4 fails inside its compiler with
    ``module 'numpy' has no attribute 'row_stack'`` under NumPy 2.5, seen on an H200
    machine. A codec that meets a missing compiler library, or any error raised while
    Numba compiles (not while a compiled kernel runs), falls back to its PyTorch reference
    on the GPU (same bytes, slower) and warns once per codec instance, naming the versions
    and :data:`CUDA_EXTRA_HINT`. Errors of the driver (out of memory, a failed launch)
    and errors outside Numba propagate: the reference would meet them too, or they are bugs.
    """
    from numba.cuda.cudadrv import driver as cuda_driver
    from numba.cuda.cudadrv import error as cuda_error

    driver_names = ("CudaAPIError", "CudaDriverError")
    found = (getattr(cuda_driver, n, None) for n in driver_names)
    driver_errors = tuple(c for c in found if isinstance(c, type))
    if driver_errors and isinstance(exc, driver_errors):
        return False
    names = ("NvvmSupportError", "NvvmError", "NvrtcError", "NvrtcSupportError", "CCSupportError")
    compile_errors = tuple(c for c in (getattr(cuda_error, n, None) for n in names) if isinstance(c, type))
    if compile_errors and isinstance(exc, compile_errors):
        return True
    text = str(exc).lower()
    if isinstance(exc, (OSError, RuntimeError, ImportError)) and any(
        word in text for word in ("libdevice", "nvvm", "nvrtc", "libcudart", "cuda_runtime.h")
    ):
        return True
    return _raised_while_compiling(exc)


# Numba's functions that compile a kernel for the argument types of a launch.
_COMPILE_FUNCTIONS = frozenset({"compile", "compile_cuda", "compile_extra", "_compile_for_args",
                                "compile_ptx"})


def _raised_while_compiling(exc: BaseException) -> bool:
    """True when ``exc``'s traceback passes through one of Numba's compile functions."""
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name in _COMPILE_FUNCTIONS and "/numba/" in code.co_filename.replace("\\", "/"):
            return True
        tb = tb.tb_next
    return False


def _versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for dist in ("numba-cuda", "numba", "numpy"):
        try:
            found.append(f"{dist} {version(dist)}")
        except PackageNotFoundError:
            continue
    return ", ".join(found)


def warn_cuda_fallback(codec: str, exc: BaseException) -> None:
    """Re-raise ``exc`` unless the CUDA kernels cannot be built; then warn (NOTE [ CUDA fallback ]).

    :meth:`CudaFallback.run` calls it and runs the reference from then on.
    """
    if not is_cuda_compile_error(exc):
        raise exc
    warnings.warn(
        f"{codec!r}: the CUDA kernels could not be compiled ({type(exc).__name__}: {exc}; {_versions()}); "
        f"using the PyTorch reference on the GPU instead (same bytes, slower). {CUDA_EXTRA_HINT}; "
        "if the error names NumPy, a NumPy this numba-cuda supports (or a newer numba-cuda)",
        RuntimeWarning,
        stacklevel=4,
    )


_T = TypeVar("_T")


class CudaFallback:
    """One codec instance's CUDA path (NOTE [ CUDA fallback ]): its kernels until they fail
    to compile, then its PyTorch reference, with one warning.

    Attributes:
        codec: the codec's name, for the warning.
        failed: whether the kernels failed to compile (the reference runs from then on).
    """

    def __init__(self, codec: str) -> None:
        self.codec = codec
        self.failed = False

    def run(self, kernels: Callable[[], _T], reference: Callable[[], _T]) -> _T:
        """``kernels()``, or ``reference()`` once they have failed to compile.

        Any error other than a compile failure propagates (:func:`warn_cuda_fallback`).
        """
        if not self.failed:
            try:
                return kernels()
            except Exception as exc:
                warn_cuda_fallback(self.codec, exc)
                self.failed = True
        return reference()


def require_tensor(t: object, codec: str) -> None:
    """Raise a :class:`CodecError` naming ``codec`` unless ``t`` is a dense tensor with data.

    Codecs read a tensor's values through a flat view, which sparse, nested and
    quantized tensors do not have, and meta tensors have no values at all.
    """
    if not isinstance(t, torch.Tensor):
        raise CodecError(
            f"{codec!r} encodes a torch.Tensor, got {type(t).__name__}; convert it with torch.as_tensor"
        )
    if t.is_nested:
        raise CodecError(
            f"{codec!r} encodes dense tensors, got a nested tensor; encode its components "
            "(t.unbind()) one by one, or t.to_padded_tensor(0.0)"
        )
    if t.layout is not torch.strided:
        raise CodecError(
            f"{codec!r} encodes dense strided tensors, got layout={t.layout}; convert it with .to_dense()"
        )
    if t.is_quantized:
        raise CodecError(
            f"{codec!r} encodes dense tensors, got a quantized one; convert it with .dequantize()"
        )
    if t.device.type == "meta":
        raise CodecError(
            f"{codec!r} got a tensor on the 'meta' device, which holds no values to compress; "
            "materialise it on a real device first (e.g. with .to_empty(device='cpu') and an initialisation)"
        )
