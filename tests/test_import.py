"""``import memctl`` must initialise no CUDA, no NVML and compile no kernel."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_import_is_side_effect_free() -> None:
    code = textwrap.dedent(
        """
        import sys
        import memctl, memctl.codecs, memctl.controller, memctl.monitor, memctl.api
        import torch
        assert not torch.cuda.is_initialized(), "torch CUDA was initialised"
        for mod in ("numba.cuda", "numba.core.registry"):
            assert mod not in sys.modules, f"{mod} imported by import memctl"
        # torch itself imports pynvml; what matters is that the NVML library is not loaded.
        pynvml = sys.modules.get("pynvml")
        assert pynvml is None or (pynvml.nvmlLib is None and pynvml._nvmlLib_refcount == 0), "NVML was loaded"
        assert "numba" not in sys.modules, "numba imported (and may JIT) at import time"
        print("clean")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "clean"


def test_version_command() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "memctl", "--version"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith("memctl ")
