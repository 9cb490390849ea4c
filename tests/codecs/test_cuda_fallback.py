"""NOTE [ CUDA fallback ]: what sends a codec to its PyTorch reference, and what propagates."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from memctl.codecs import _backend


def _raiser(function: str, filename: str, exc: str) -> Callable[[], None]:
    """A function named ``function`` whose code lives in ``filename`` and raises ``exc``."""
    namespace: dict[str, object] = {}
    exec(compile(f"def {function}():\n    raise {exc}\n", filename, "exec"), namespace)
    fn = namespace[function]
    assert callable(fn)
    return fn  # type: ignore[return-value]


# numba-cuda 0.30.4 under NumPy 2.5, on an H200 machine: raised inside the compiler
_NUMPY_BREAK = "AttributeError(\"module 'numpy' has no attribute 'row_stack'\")"
_COMPILER = "/venv/lib/python3.12/site-packages/numba_cuda/numba/cuda/compiler.py"


def _caught(fn: Callable[[], None]) -> BaseException:
    with pytest.raises(Exception) as info:
        fn()
    return info.value


def test_an_error_inside_numbas_compiler_is_a_compile_failure() -> None:
    exc = _caught(_raiser("compile_cuda", _COMPILER, _NUMPY_BREAK))
    assert _backend.is_cuda_compile_error(exc)


@pytest.mark.parametrize(("function", "filename"), [
    ("compile_cuda", "/work/project/mycode.py"),  # not Numba's
    ("launch", _COMPILER),  # Numba's, but running a compiled kernel
])
def test_other_errors_are_not_compile_failures(function: str, filename: str) -> None:
    exc = _caught(_raiser(function, filename, _NUMPY_BREAK))
    assert not _backend.is_cuda_compile_error(exc)


def test_fallback_runs_the_reference_once_kernels_fail_to_compile() -> None:
    fallback = _backend.CudaFallback("quantize")
    broken = _raiser("compile_cuda", _COMPILER, _NUMPY_BREAK)
    calls: list[str] = []

    def kernels() -> str:
        calls.append("kernels")
        broken()
        return "kernels"

    with pytest.warns(RuntimeWarning, match=r"row_stack.*numpy \d"):
        assert fallback.run(kernels, lambda: "reference") == "reference"
    assert fallback.failed
    assert fallback.run(kernels, lambda: "reference") == "reference"
    assert calls == ["kernels"]  # not tried again


def test_a_bug_outside_numba_propagates() -> None:
    fallback = _backend.CudaFallback("quantize")
    with pytest.raises(ZeroDivisionError):
        fallback.run(_raiser("encode", "/work/project/mycode.py", "ZeroDivisionError()"), lambda: None)
    assert not fallback.failed
