"""Codec throughput and compression ratio, side by side with the machine's copy bandwidth.

Run ``python benchmarks/codecs.py [--numel 67108864] [--device cpu|cuda] [--repeat 5] [--quick]``.

For one float32 activation-like tensor (ReLU of a smooth random field: about half exact
zeros) it prints, per codec and setting (quantize at 1/2/4/8 bits, lossless, and errorbound
at a few absolute bounds when ``memctl.codecs.errorbound`` is importable): encode and
decode throughput in GB/s of *input* (float32 bytes per second), each one's ratio to the
copy bandwidth measured in the same run (``torch.clone`` of the input, timed between the
codecs, best over the run), the compression ratio and the largest absolute error.
Then, for errorbound, the ratios that SZ3 (``pysz``, absolute bound) and ZFP (``zfpy``,
fixed-accuracy mode, whose tolerance is an absolute bound) reach at the same bounds on
the same data, for the ReLU activation and for a smooth array. Every figure is the best of
``--repeat`` rounds, each round timing the copy and every codec once, in turn, after a
warm-up call of each (which also compiles the Numba kernels). Prints
figures, asserts nothing; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from memctl import codecs

TARGETS = (
    "targets: CPU 2-bit encode >= 50% of copy bandwidth; GPU 2-bit encode >= 70%; "
    "2-bit float32 compression ratio >= 14x"
)
QUICK_NUMEL = 4 * 2**20
BOUNDS = (1e-2, 1e-3, 1e-4)


def _progress(msg: str) -> None:
    print(f"[codecs] {msg}", file=sys.stderr, flush=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Wall time of one call of ``fn`` (synchronising the device around it)."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def smooth_field(numel: int, device: torch.device, seed: int) -> torch.Tensor:
    """A smooth random 1-D field (linear interpolation of coarse noise plus two sinusoids), float32."""
    gen = torch.Generator().manual_seed(seed)
    coarse = torch.randn(max(2, numel // 64), generator=gen)
    field = torch.nn.functional.interpolate(coarse[None, None], size=numel, mode="linear", align_corners=True)
    t = torch.linspace(0.0, 40.0 * math.pi, numel)
    x = field.reshape(-1) + 0.5 * torch.sin(t) + 0.25 * torch.sin(7.3 * t)
    return x.to(device=device, dtype=torch.float32).contiguous()


def relu_activation(numel: int, device: torch.device, seed: int) -> torch.Tensor:
    """ReLU of a smooth random field: about half of the values exactly zero."""
    return torch.relu(smooth_field(numel, device, seed))


def machine(device: torch.device) -> str:
    import numba

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    text = (
        f"{cpu}, {os.cpu_count()} CPUs, torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"numba {numba.__version__} ({numba.get_num_threads()} threads)"
    )
    if device.type == "cuda":
        text += f", GPU {torch.cuda.get_device_name(device)}"
    return text


def codec_settings() -> list[tuple[str, str, dict[str, Any]]]:
    """(codec, label, encode kwargs) rows; errorbound only when it can be imported."""
    rows: list[tuple[str, str, dict[str, Any]]] = [
        ("quantize", f"{b} bits", {"bits": b, "seed": 1}) for b in (1, 2, 4, 8)
    ]
    rows.append(("lossless", "raw", {}))
    try:
        import memctl.codecs.errorbound  # noqa: F401
    except ImportError as exc:
        _progress(f"errorbound skipped: {exc}")
    else:
        rows += [("errorbound", f"abs {e:g}", {"error_bound": e}) for e in BOUNDS]
    return rows


def throughput_table(x: torch.Tensor, repeat: int) -> tuple[float, list[str]]:
    """(best copy seconds, table lines).

    After a warm-up of every codec (Numba compiles there), ``repeat`` rounds each time the
    copy and every codec's encode and decode once, and the best time of each is kept:
    interleaving spreads a busy machine's slow moments over all figures alike.
    """
    device = x.device
    gb = x.numel() * x.element_size() / 1e9
    settings = codec_settings()
    instances = [codecs.get(name) for name, _, _ in settings]
    records = []
    for (name, label, kwargs), codec in zip(settings, instances, strict=True):
        _progress(f"warm-up {name} {label}")
        records.append(codec.encode(x, **kwargs))
        codec.decode(records[-1])
    copy_s = math.inf
    enc_s = [math.inf] * len(settings)
    dec_s = [math.inf] * len(settings)
    for r in range(repeat):
        _progress(f"round {r + 1}/{repeat}")
        copy_s = min(copy_s, timed(lambda: x.clone(), device))
        for i, ((_, _, kwargs), codec) in enumerate(zip(settings, instances, strict=True)):
            enc_s[i] = min(enc_s[i], timed(lambda c=codec, k=kwargs: c.encode(x, **k), device))
            dec_s[i] = min(dec_s[i], timed(lambda c=codec, p=records[i]: c.decode(p), device))
            copy_s = min(copy_s, timed(lambda: x.clone(), device))
    lines = [
        f"{'codec':<11}{'setting':<11}{'enc GB/s':>9}{'enc/copy':>9}{'dec GB/s':>9}{'dec/copy':>9}"
        f"{'ratio':>8}{'max|err|':>11}"
    ]
    for i, ((name, label, _), codec) in enumerate(zip(settings, instances, strict=True)):
        p = records[i]
        err = float((codec.decode(p).double() - x.double()).abs().max()) if x.numel() else 0.0
        lines.append(
            f"{name:<11}{label:<11}{gb / enc_s[i]:>9.2f}{copy_s / enc_s[i]:>9.2f}{gb / dec_s[i]:>9.2f}"
            f"{copy_s / dec_s[i]:>9.2f}{p.ratio:>8.2f}{err:>11.3g}"
        )
    return copy_s, lines


def reference_ratios(datasets: dict[str, torch.Tensor]) -> list[str]:
    """errorbound against SZ3 and ZFP at the same absolute bounds, on the same arrays."""
    try:
        import memctl.codecs.errorbound  # noqa: F401
    except ImportError:
        return ["(errorbound not importable: no comparison)"]
    try:
        import zfpy
        from pysz import sz, szConfig, szErrorBoundMode
    except ImportError as exc:
        return [f"(pysz/zfpy missing: {exc}; pip install 'memctl[bench]')"]
    lines = [f"{'data':<8}{'bound':>9}{'errorbound':>12}{'SZ3':>9}{'ZFP':>9}"]
    codec = codecs.get("errorbound")
    for dname, x in datasets.items():
        arr = x.detach().cpu().numpy()
        for e in BOUNDS:
            _progress(f"ratios: {dname} at {e:g}")
            ours = codec.encode(x, error_bound=e).ratio
            conf = szConfig()
            conf.errorBoundMode = szErrorBoundMode.ABS
            conf.absErrorBound = e
            compressed, _ = sz.compress(arr, conf)
            compressed = np.array(compressed, copy=True)  # SZ3 returns a view into an oversized buffer
            sz_ratio = arr.nbytes / compressed.nbytes
            zfp_ratio = arr.nbytes / len(zfpy.compress_numpy(arr, tolerance=e))
            lines.append(f"{dname:<8}{e:>9.0e}{ours:>12.2f}{sz_ratio:>9.2f}{zfp_ratio:>9.2f}")
    return lines


SMALL_SIZES = (1024, 65536, 1 << 20)


def per_call_table(device: torch.device, reps: int) -> list[str]:
    """Microseconds per call on small tensors (wall time over ``reps`` calls, one sync after them):
    what a launch costs where the data is too small for throughput to matter, against PyTorch's
    own launch (``torch.clone``) and the codec's PyTorch reference."""
    def per_call(fn: Callable[[], object], n: int = reps) -> float:
        fn()
        fn()
        _sync(device)
        start = time.perf_counter()
        for _ in range(n):
            fn()
        _sync(device)
        return (time.perf_counter() - start) / n * 1e6

    lines = [f"{'values':>9}{'clone':>9}{'q enc':>9}{'q dec':>9}{'q dec+mask':>11}{'l enc':>9}{'l dec':>9}"
             f"{'q enc ref':>11}"]
    for n in SMALL_SIZES:
        _progress(f"per call: {n} values")
        lines.append(f"{n:>9}" + "".join(f"{v:>{w}.1f}" for v, w in
                                         zip(_small_row(n, device, per_call), (9, 9, 9, 11, 9, 9, 11),
                                             strict=True)))
    return lines


def _small_row(n: int, device: torch.device, per_call: Callable[..., float]) -> list[float]:
    quantize, lossless = codecs.get("quantize"), codecs.get("lossless")
    x = relu_activation(n, device, 0)
    record = quantize.encode(x, bits=2)
    mask = lossless.encode(x > 0)
    return [per_call(lambda: x.clone()), per_call(lambda: quantize.encode(x, bits=2)),
            per_call(lambda: quantize.decode(record)), per_call(lambda: quantize.decode(record, mask=mask)),
            per_call(lambda: lossless.encode(x > 0)), per_call(lambda: lossless.decode(mask)),
            per_call(lambda: quantize.encode(x, bits=2, impl="reference"), 3)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, default=None, help="values per tensor (default 64M)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if available")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per figure (best is kept)")
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK_NUMEL} values, 2 repeats")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--calls", type=int, default=300, help="calls per small-tensor figure")
    args = parser.parse_args(argv)
    if args.quick:
        args.calls = min(args.calls, 20)
    numel = args.numel if args.numel is not None else (QUICK_NUMEL if args.quick else 64 * 2**20)
    repeat = 2 if args.quick else args.repeat
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))

    _progress(f"building {numel} values on {device}")
    x = relu_activation(numel, device, args.seed)
    gb = numel * 4 / 1e9
    copy_s, table = throughput_table(x, repeat)
    print(f"memctl codec benchmark, {datetime.date.today().isoformat()}")
    print(f"machine: {machine(device)}")
    print(f"device: {device}; input: {numel} float32 values ({gb * 1e3:.1f} MB), ReLU of a smooth field, "
          f"{float((x == 0).double().mean()):.0%} zeros; best of {repeat}")
    print(TARGETS)
    print(f"copy bandwidth (torch.clone, best over the run, GB/s of input): {gb / copy_s:.2f}")
    print()
    for line in table:
        print(line)
    print()
    print(f"per call on small tensors, microseconds (2 bits; q: quantize, l: lossless; ref: the PyTorch "
          f"reference; {args.calls} calls, one sync after them)")
    for line in per_call_table(device, args.calls):
        print(line)
    print()
    print("compression ratio at the same absolute bound (SZ3: pysz ABS mode; ZFP: zfpy fixed accuracy)")
    datasets = {"relu": x, "smooth": smooth_field(numel, device, args.seed + 1)}
    for line in reference_ratios(datasets):
        print(line)


if __name__ == "__main__":
    main()
