"""First-use cost of memctl's CPU kernels: a cold Numba cache, then a warm one, one process each.

Each measurement runs in a fresh process with ``NUMBA_CACHE_DIR`` pointing at a new
temporary directory (cold: nothing cached) and then at the same directory again (warm),
and times the first encode and decode of each codec, split into Numba's own start-up
(``import numba`` and its CPU target, paid by any Numba user) and the kernels' compile or
cache load.

    python benchmarks/kernel_cache.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

_CHILD = r"""
import json, time
import torch
t0 = time.perf_counter()
import numba
@numba.njit(cache=False)
def _warm(a):
    return a + 1
_warm(1)  # Numba's CPU target initialised: what every Numba user pays once
t1 = time.perf_counter()
from memctl import codecs
x = torch.randn(300_000)
m = x > 0
for name, kw in (("quantize", {"bits": 2}), ("lossless", {}), ("errorbound", {"error_bound": 1e-2})):
    c = codecs.get(name)
    small, big = (m[:1000], m) if name == "lossless" else (x[:1000], x)
    for t in (small, big):
        c.decode(c.encode(t, **kw))
t2 = time.perf_counter()
print(json.dumps({"numba_start_s": t1 - t0, "kernels_s": t2 - t1}))
"""


def _run(cache_dir: str) -> dict[str, float]:
    env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir)
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, check=True, capture_output=True, text=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    with tempfile.TemporaryDirectory() as cache_dir:
        cold = _run(cache_dir)
        warm = [_run(cache_dir) for _ in range(2)]
    print("first encode+decode of quantize, lossless, errorbound (1k and 300k values), one process each")
    print(f"{'cache':<6} {'numba start-up s':>17} {'kernels s':>10}")
    for label, r in (("cold", cold), ("warm", warm[0]), ("warm", warm[1])):
        print(f"{label:<6} {r['numba_start_s']:>17.2f} {r['kernels_s']:>10.2f}")
    with open("/proc/loadavg") as f:
        print("load average:", f.read().split()[:3])


if __name__ == "__main__":
    main()
