"""Shapes of the quantize codec's warp-team CUDA kernels, side by side, each in its own process.

NOTE [ Quantize CUDA kernels ] (``memctl/codecs/quantize/_kernels.py``) fixes two numbers of
the team kernels: the blocks of 128 threads per multiprocessor (``BLOCKS_PER_SM``, which is
also the launch bound and so caps the registers a thread may use) and the values each lane
holds (``chunk_for``). This script builds the kernels with other values of both and prints,
per shape:

- whether the encode writes the same payload, metadata and exception list as the PyTorch
  reference, and whether plain and masked decodes give the reference's values (on 4M+77
  values with a NaN among them, so the exception path runs too);
- encode, decode and masked-decode throughput on ``--numel`` float32 values (a ReLU of
  Gaussian values scaled per 256), in GB/s of input and as a share of ``torch.clone``'s,
  best of 5.

Every shape runs in a fresh process, because the kernels are built once per process.

    python benchmarks/kernel_variants.py                 # the shapes of the README's table
    python benchmarks/kernel_variants.py --shape 2,4,16  # one shape: bits, blocks/SM, values/lane
    python benchmarks/kernel_variants.py --variants all --shapes 2,4,16 4,4,8
        # every encode variant (NOTE [ Team kernel variants ]) at those shapes, one process each

With ``--variants`` it runs the encode variants of NOTE [ Team kernel variants ]
(``memctl/codecs/quantize/_cuda_variants.py``) instead, each at each of ``--shapes`` (default
``TODAY``), one process and one line each; ``base`` is today's kernels.

It needs a CUDA device. Under Numba's simulator (``NUMBA_ENABLE_CUDASIM=1``) it checks
exactness only, on a small ``--numel``. Under Nsight Compute, one shape's kernels can be
profiled::

    ncu --kernel-name regex:"encode|decode" --launch-count 4 --section SpeedOfLight \\
        python benchmarks/kernel_variants.py --shape 2,4,16 --repeat 1
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Callable

import torch

#: (bits, blocks per multiprocessor, values per lane); the first of each width is today's.
SHAPES = (
    (2, 4, 16), (2, 3, 16), (2, 2, 16), (2, 4, 8), (2, 8, 8), (2, 2, 8),
    (4, 4, 8), (4, 3, 8), (4, 2, 8),
    (8, 4, 8), (8, 2, 8),
    (1, 4, 16), (1, 2, 16),
)


def _field(n: int, seed: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(n // 256 + 1, generator=g).repeat_interleave(256)[:n] * 4
    return torch.relu(torch.randn(n, generator=g) * scale).to(device)


#: Today's shape of each width, for ``--variants`` without ``--shapes``.
TODAY = ((2, 4, 16), (4, 4, 8), (8, 4, 8), (1, 4, 16))


def run_shape(bits: int, blocks: int, chunk: int, numel: int, repeat: int, variant: str = "base") -> str:
    """One line: exactness against the reference and throughput, for one kernel shape and variant."""
    from memctl import codecs
    from memctl.codecs.quantize import _cuda_teams, _cuda_variants

    _cuda_teams.BLOCKS_PER_SM = blocks  # read when the kernels are built and launched
    _cuda_teams.chunk_for = lambda group, b: chunk  # type: ignore[assignment]
    chosen = _cuda_variants.Variant(variant)
    _cuda_teams.team_kernels = (  # type: ignore[assignment]
        lambda b, c, simulated: _cuda_variants.team_kernels(b, c, simulated, chosen))
    device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: the simulator
    q, lossless = codecs.get("quantize"), codecs.get("lossless")

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        if a.is_floating_point():  # a NaN listed as an exception equals itself here
            a, b = a.nan_to_num(7.0), b.nan_to_num(7.0)
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)

    small = _field(min(numel, 1 << 22) + 77, 1, device)
    small[5] = float("nan")
    mask = lossless.encode(small > 0)
    ours = q.encode(small, bits=bits, seed=3, impl="cuda")
    ref = q.encode(small, bits=bits, seed=3, impl="reference")
    enc_ok = set(ours.buffers) == set(ref.buffers) and all(same(ours.buffers[k], ref.buffers[k])
                                                           for k in ref.buffers)
    dec_ok = same(q.decode(ours, impl="cuda"), q.decode(ref, impl="reference"))
    masked_ok = same(q.decode(ours, impl="cuda", mask=mask), q.decode(ref, impl="reference", mask=mask))
    head = (f"{_label(bits, blocks, chunk, variant)}: exact encode {enc_ok} "
            f"decode {dec_ok} masked {masked_ok}")
    if device != "cuda":
        return head

    def best(fn: Callable[[], object]) -> float:
        times = []
        for _ in range(repeat):
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return min(times)

    x = _field(numel, 2, device)
    gb = x.numel() * 4 / 1e9
    record = q.encode(x, bits=bits, impl="cuda")
    big_mask = lossless.encode(x > 0)
    q.decode(record, impl="cuda", mask=big_mask)  # every kernel built before timing
    copy = gb / best(lambda: x.clone())
    rates = [gb / best(fn) for fn in (lambda: q.encode(x, bits=bits, impl="cuda"),
                                      lambda: q.decode(record, impl="cuda"),
                                      lambda: q.decode(record, impl="cuda", mask=big_mask))]
    enc, dec, masked = rates
    return (f"{head}; copy {copy:.0f} GB/s, encode {enc:.0f} ({enc / copy:.2f}), decode {dec:.0f} "
            f"({dec / copy:.2f}), masked decode {masked:.0f} ({masked / copy:.2f})")


def _label(bits: int, blocks: int, chunk: int, variant: str) -> str:
    tail = "" if variant == "base" else f" variant {variant}"
    return f"bits {bits} blocks/SM {blocks} values/lane {chunk}{tail}"


def _in_process(bits: int, blocks: int, chunk: int, variant: str, args: argparse.Namespace) -> None:
    """Print the line of one shape and variant, run in a fresh process."""
    cmd = [sys.executable, __file__, "--shape", f"{bits},{blocks},{chunk}", "--variant", variant,
           "--numel", str(args.numel), "--repeat", str(args.repeat)]
    label = _label(bits, blocks, chunk, variant)
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("bits ")]
        print(lines[-1] if lines else f"{label}: failed (exit {out.returncode}): "
              f"{out.stderr.strip().splitlines()[-1:]}", flush=True)
    except subprocess.TimeoutExpired:
        print(f"{label}: over {args.timeout:g} s", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default=None,
                    help="bits,blocks_per_sm,values_per_lane (default: every shape of SHAPES)")
    ap.add_argument("--numel", type=int, default=64 * 2**20, help="values timed (default 64M)")
    ap.add_argument("--repeat", type=int, default=5, help="timed calls per kernel, the best kept")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per shape's process")
    ap.add_argument("--variant", default="base",
                    help="the encode variant of --shape (NOTE [ Team kernel variants ]; default base)")
    ap.add_argument("--variants", default=None,
                    help="comma-separated variants, or 'all': each at each of --shapes, one process each")
    ap.add_argument("--shapes", nargs="+", default=None,
                    help="with --variants: bits,blocks_per_sm,values_per_lane ... (default: TODAY)")
    args = ap.parse_args(argv)
    if args.shape is not None:
        bits, blocks, chunk = (int(v) for v in args.shape.split(","))
        print(run_shape(bits, blocks, chunk, args.numel, args.repeat, args.variant), flush=True)
        return
    if args.variants is not None:
        from memctl.codecs.quantize._cuda_variants import Variant  # imports numba.cuda, not a GPU context

        names = [v.value for v in Variant] if args.variants == "all" else args.variants.split(",")
        for name in names:
            Variant(name)  # an unknown name fails here, before any process starts
        shapes = TODAY if args.shapes is None else [tuple(int(v) for v in s.split(",")) for s in args.shapes]
        for bits, blocks, chunk in shapes:
            for name in names:
                _in_process(bits, blocks, chunk, name, args)
        return
    for bits, blocks, chunk in SHAPES:
        _in_process(bits, blocks, chunk, args.variant, args)


if __name__ == "__main__":
    main()
