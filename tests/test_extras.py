"""Lean installs: memctl imports and trains without its extras, and says which extra is missing."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from memctl import _extras
from memctl.errors import MissingExtraError

ROOT = Path(__file__).resolve().parents[1]

# Packages that only the extras bring. ``sys.modules[name] = None`` makes ``import name`` (and
# of anything under it) raise ModuleNotFoundError and ``importlib.util.find_spec(name)`` return
# None: exactly what an environment without the package shows.
_BLOCKER = textwrap.dedent(
    """
    import sys
    BLOCKED = ("sklearn", "matplotlib", "lightning", "pytorch_lightning", "transformers",
               "accelerate", "tensorboard", "selenium")
    for name in list(sys.modules):
        if name.split(".")[0] in BLOCKED:
            del sys.modules[name]
    for name in BLOCKED:
        sys.modules[name] = None
    """
)


def _run(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _BLOCKER + textwrap.dedent(code), *args],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_controller_trains_without_any_extra() -> None:
    out = _run(
        """
        import torch, memctl, memctl.api, memctl.integrations
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ctl = memctl.Controller(model, opt, bits=2.0, monitor_interval_s=0)
        for _ in range(3):
            x, y = torch.randn(64, 256), torch.randint(0, 4, (64,))
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step(); opt.zero_grad()
        s = ctl.stats()
        assert s["step"] == 3 and s["ratio"] > 1, s
        ctl.detach()
        leaked = sorted(m for m, v in sys.modules.items() if m.split(".")[0] in BLOCKED and v is not None)
        assert not leaked, leaked
        print("trained")
        """
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "trained"


def test_demo_names_the_missing_extra_in_one_line() -> None:
    out = _run("from memctl.cli import main; sys.exit(main(['demo', '--steps', '1']))")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "scikit-learn, matplotlib" in lines[0] and "pip install 'memctl[demo]'" in lines[0]


def test_require_passes_when_installed_and_names_the_extra_when_not(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(_extras.EXTRAS, "demo", (("json", "json"),))
    _extras.require("demo", "x")  # json is always there
    monkeypatch.setitem(_extras.EXTRAS, "demo", (("json", "json"), ("no_such_module_x", "nosuch")))
    assert _extras.missing("demo") == ["nosuch"]
    expected = r"feature needs nosuch, which is not installed.*memctl\[demo\]"
    with pytest.raises(MissingExtraError, match=expected):
        _extras.require("demo", "feature")
    with pytest.raises(KeyError, match="unknown extra"):
        _extras.missing("nope")


def test_core_dependencies_leave_the_extras_out() -> None:
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {dep.split(">")[0].split("=")[0].split("<")[0].strip() for dep in project["dependencies"]}
    assert {"torch", "numba", "numba-cuda", "nvidia-ml-py", "scipy", "fastapi", "uvicorn"} <= core
    assert not core & {"scikit-learn", "matplotlib", "lightning", "transformers", "tensorboard"}
    torch_req = next(d for d in project["dependencies"] if d.startswith("torch"))
    assert ">=" in torch_req and "<" in torch_req.replace("<=", "<")  # a declared, bounded range
    extras = project["optional-dependencies"]
    for extra, packages in _extras.EXTRAS.items():
        declared = " ".join(extras[extra])
        assert all(dist in declared for _, dist in packages), extra


@pytest.mark.parametrize(("module", "extra"), [("lightning", "lightning"), ("huggingface", "huggingface"),
                                               ("tensorboard", "tensorboard")])
def test_integrations_name_their_extra_when_it_is_missing(module: str, extra: str) -> None:
    out = _run(
        f"""
        from memctl.errors import MissingExtraError
        try:
            import memctl.integrations.{module}
        except MissingExtraError as exc:
            print(exc)
        """
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"pip install 'memctl[{extra}]'" in out.stdout


def test_a_broken_dependency_of_an_extra_is_named() -> None:
    # A torchvision built for another torch fails at import with a RuntimeError; any failure
    # of an installed extra's import becomes one MissingExtraError that says what to do.
    out = _run(
        """
        import importlib.abc
        from memctl import _extras
        from memctl.errors import MissingExtraError

        class Broken(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "email.memctl_probe":
                    raise RuntimeError("operator torchvision::nms does not exist")
                return None

        sys.meta_path.insert(0, Broken())
        _extras.EXTRAS["probe"] = (("email", "email"),)
        try:
            _extras.import_extra("email.memctl_probe", "probe", "the probe feature")
        except MissingExtraError as exc:
            print(exc)
        """
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "email.memctl_probe is installed but importing it failed (RuntimeError: operator" in out.stdout
    assert "torchvision release that matches torch" in out.stdout
