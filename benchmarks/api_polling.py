"""Does polling the HTTP API slow training down? Step time with and without a busy client.

Run ``python benchmarks/api_polling.py [--steps 200] [--requests 1000] [--rounds 10]``.
A small CNN trains on CPU with a memctl Controller (2 bits on average) serving its API on a
loopback port. Training alternates between three modes, ``--steps`` steps each in all:

- ``baseline``: nobody polls;
- ``process``: a separate client process sends GETs, alternating ``/v1/stats`` and
  ``/metrics`` on one keep-alive connection, at a fixed rate chosen so that about
  ``--requests`` of them fall within this mode's steps (like Prometheus or ``memctl status``);
- ``thread``: the same client as a thread inside the training process, which also competes
  for the GIL.

NOTE [ Interleaved blocks ]
On a shared machine the step time drifts by tens of percent between two identical runs (other
processes, CPU frequency, and on 2 cores the OpenMP threads of PyTorch and Numba stalling when
anything else runs). Running the modes one after another would measure that drift. So each
mode's steps are split into ``--rounds`` blocks, the blocks are interleaved (the order rotates
every round) and the figures are compared within rounds: drift hits every mode alike.

Prints the mean and median step time per mode, their ratios to the baseline (target: <= 1.05,
polling must not slow training measurably), the median of the per-round ratios, the requests'
latency percentiles and the training time lost per request. Prints figures, asserts nothing.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import multiprocessing as mp
import os
import platform
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit

# Only the standard library at the top: the client process (spawned) re-imports this module.

PATHS = ("/v1/stats", "/metrics")
MODES = ("baseline", "process", "thread")
TARGET_RATIO = 1.05


class _Flag(Protocol):
    def is_set(self) -> bool: ...
    def wait(self, timeout: float | None = None) -> bool: ...


class _Value(Protocol):
    value: float


@dataclass
class _Pace:
    """The request interval (s) shared with the client thread (``multiprocessing.Value`` for the process)."""

    value: float


@dataclass
class PollResult:
    """What one client saw: per-request latency (s) and path, and the failed requests."""

    latencies: list[float] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    errors: int = 0


def poll(url: str, pace: _Value, go: _Flag, stop: _Flag) -> PollResult:
    """While ``go`` is set, GET :data:`PATHS` in turn every ``pace.value`` s; return once ``stop`` is set.

    A request that fails on a connection the server closed while the client was paused
    (uvicorn drops idle keep-alive connections after 5 s) is retried once on a new one.
    """
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    conn = http.client.HTTPConnection(host, port, timeout=30)
    result = PollResult()
    due: float | None = None
    i = 0
    while not stop.is_set():
        if not go.wait(timeout=0.02):
            due = None  # paused: restart the schedule when polling resumes
            continue
        now = time.monotonic()
        due = now if due is None else due
        if now < due:
            time.sleep(min(due - now, 0.02))
            continue
        path = PATHS[i % len(PATHS)]
        t0 = time.monotonic()
        ok = False
        for _attempt in range(2):
            try:
                conn.request("GET", path)
                resp = conn.getresponse()
                resp.read()
                ok = resp.status == 200
                break
            except (OSError, http.client.HTTPException):
                conn.close()
                conn = http.client.HTTPConnection(host, port, timeout=30)
        result.latencies.append(time.monotonic() - t0)
        result.paths.append(path)
        result.errors += not ok
        due += pace.value
        i += 1
    conn.close()
    return result


def _poll_process(url: str, pace: Any, go: Any, stop: Any, queue: Any) -> None:
    r = poll(url, pace, go, stop)
    queue.put((r.latencies, r.paths, r.errors))


def _model(width: int) -> Any:
    from torch import nn

    def stage(c_in: int, c_out: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out),
                             nn.ReLU(inplace=True))

    return nn.Sequential(stage(3, width), nn.MaxPool2d(2), stage(width, 2 * width), nn.MaxPool2d(2),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, 10))


@dataclass
class Measurement:
    steps: dict[str, list[float]]
    rounds: list[dict[str, float]]
    polls: dict[str, PollResult]


def measure(args: argparse.Namespace) -> Measurement:
    """Warm up, calibrate the request rate, then run the interleaved blocks (NOTE [ Interleaved blocks ])."""
    import torch
    from torch import nn

    import memctl

    torch.manual_seed(args.seed)
    model = _model(args.width)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(args.seed + 1)
    batches = [(torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=g),
                torch.randint(0, 10, (args.batch_size,), generator=g)) for _ in range(8)]
    ctl = memctl.Controller(model, optimizer, bits=2.0)
    handle = ctl.serve(port=0)
    counter = [0]

    def step() -> float:
        x, y = batches[counter[0] % len(batches)]
        counter[0] += 1
        t0 = time.perf_counter()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    t0 = time.monotonic()
    for _ in range(args.warmup):
        step()  # Numba compiles the codec kernels on the first step
    calib = statistics.median(step() for _ in range(10))
    interval = calib * args.steps / args.requests
    print(f"warm-up ({args.warmup} steps, kernel compilation included) and calibration: "
          f"{time.monotonic() - t0:.1f} s; step ~{calib * 1e3:.1f} ms, so one request every "
          f"{interval * 1e3:.1f} ms ({1 / interval:.0f} requests/s) while a client polls")

    # The interval follows the step time measured so far, so that about --requests requests
    # fall within a mode's steps even when the machine slows down.
    ctx = mp.get_context("spawn")
    proc_pace, thread_pace = ctx.Value("d", interval), _Pace(interval)
    proc_go, proc_stop, queue = ctx.Event(), ctx.Event(), ctx.Queue()
    worker = ctx.Process(target=_poll_process, args=(handle.url, proc_pace, proc_go, proc_stop, queue),
                         daemon=True)
    worker.start()
    thread_go, thread_stop = threading.Event(), threading.Event()
    thread_result: list[PollResult] = []
    thread = threading.Thread(
        target=lambda: thread_result.append(poll(handle.url, thread_pace, thread_go, thread_stop)),
        daemon=True)
    thread.start()
    time.sleep(1.0)  # let the client process start before the first block

    go = {"baseline": None, "process": proc_go, "thread": thread_go}
    steps: dict[str, list[float]] = {m: [] for m in MODES}
    rounds: list[dict[str, float]] = []
    sizes = [args.steps // args.rounds + (r < args.steps % args.rounds) for r in range(args.rounds)]
    for r, block in enumerate(sizes):
        order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]
        this_round: dict[str, float] = {}
        for mode in order:
            flag = go[mode]
            if flag is not None:
                flag.set()
            times = [step() for _ in range(block)]
            if flag is not None:
                flag.clear()
            steps[mode].extend(times)
            this_round[mode] = statistics.fmean(times)
            if mode != "baseline":
                pace = statistics.fmean(steps[mode]) * args.steps / args.requests
                (proc_pace if mode == "process" else thread_pace).value = pace
        rounds.append(this_round)

    proc_stop.set()
    thread_stop.set()
    latencies, paths, errors = queue.get(timeout=120)
    worker.join(30)
    thread.join(30)
    ctl.detach()
    handle.close()
    polls = {"process": PollResult(latencies, paths, errors), "thread": thread_result[0]}
    return Measurement(steps, rounds, polls)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def report(m: Measurement) -> None:
    base_mean = statistics.fmean(m.steps["baseline"])
    base_median = statistics.median(m.steps["baseline"])
    print("\nstep time per mode (ratios to the baseline); round ratio: median over rounds of the")
    print("mode's block mean over the same round's baseline block mean")
    print(f"{'mode':<10}{'steps':>7}{'mean ms':>10}{'ratio':>8}{'median ms':>11}{'ratio':>8}"
          f"{'round ratio':>13}{'requests/s':>12}")
    for mode in MODES:
        t = m.steps[mode]
        mean, median = statistics.fmean(t), statistics.median(t)
        per_round = statistics.median(r[mode] / r["baseline"] for r in m.rounds)
        rate = len(m.polls[mode].latencies) / sum(t) if mode in m.polls else 0.0
        print(f"{mode:<10}{len(t):>7}{mean * 1e3:>10.2f}{mean / base_mean:>8.3f}{median * 1e3:>11.2f}"
              f"{median / base_median:>8.3f}{per_round:>13.3f}{rate:>12.1f}")

    print(f"\n{'client':<10}{'path':<11}{'requests':>9}{'errors':>8}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}"
          f"{'max ms':>9}")
    for mode, result in m.polls.items():
        for path in (*PATHS, "all"):
            lat = [v * 1e3 for v, p in zip(result.latencies, result.paths, strict=True) if path in (p, "all")]
            if lat:
                errors = result.errors if path == "all" else ""
                print(f"{mode:<10}{path:<11}{len(lat):>9}{errors:>8}{_pct(lat, 50):>9.2f}"
                      f"{_pct(lat, 90):>9.2f}{_pct(lat, 99):>9.2f}{max(lat):>9.2f}")

    print()
    worst, rates = 0.0, []
    for mode, result in m.polls.items():
        t = m.steps[mode]
        ratio = statistics.fmean(t) / base_mean
        worst = max(worst, ratio)
        rates.append(len(result.latencies) / sum(t))
        if result.latencies:
            lost = (sum(t) - base_mean * len(t)) / len(result.latencies)
            print(f"{mode:<8} training time lost per request {lost * 1e3:6.2f} ms; at one scrape every 15 s "
                  f"that would be {max(lost, 0.0) / 15 * 100:.3f}% of the run, at one request a second "
                  f"(a live dashboard) {max(lost, 0.0) * 100:.2f}%")
    verdict = "within" if worst <= TARGET_RATIO else "ABOVE"
    print(f"worst polled/baseline mean step-time ratio {worst:.3f}: {verdict} the target {TARGET_RATIO} "
          f"at {min(rates):.0f}-{max(rates):.0f} requests/s")
    print(f"load average at the end: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=200, help="training steps per mode (200)")
    parser.add_argument("--requests", type=int, default=1000,
                        help="GET requests a client sends during its mode's steps, about (1000)")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved blocks per mode (10)")
    parser.add_argument("--batch-size", type=int, default=64, help="batch size (64)")
    parser.add_argument("--image-size", type=int, default=32, help="image height and width (32)")
    parser.add_argument("--width", type=int, default=16, help="channels of the first conv (16)")
    parser.add_argument("--warmup", type=int, default=10, help="steps run first to compile kernels (10)")
    parser.add_argument("--torch-threads", type=int, default=0,
                        help="torch.set_num_threads for training (0: torch's default, one per core)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not 1 <= args.rounds <= args.steps:
        parser.error(f"--rounds {args.rounds}: must be between 1 and --steps ({args.steps})")

    import torch

    import memctl

    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    cpu = platform.processor() or platform.machine()
    print(f"memctl {memctl.__version__}, torch {torch.__version__}, {cpu}, {os.cpu_count()} CPUs, "
          f"{torch.get_num_threads()} torch threads, {datetime.date.today()}, "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"{args.steps} steps per mode in {args.rounds} interleaved blocks, batch {args.batch_size} of "
          f"3x{args.image_size}x{args.image_size}; clients alternate {', '.join(PATHS)}")
    report(measure(args))


if __name__ == "__main__":
    main()
