"""The ``memctl`` command line: ``demo``, ``status`` and ``budget``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from memctl._version import __version__

__all__ = ["build_parser", "main"]

DEFAULT_URL = "http://127.0.0.1:8765"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="memctl",
        description="Runtime memory manager for PyTorch training: compressed saved activations "
        "under a live memory budget.",
    )
    parser.add_argument("--version", action="version", version=f"memctl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = sub.add_parser(
        "demo",
        help="train a CNN on scikit-learn's digits, plain and with memctl, and compare",
        description="Train a small residual CNN on scikit-learn's handwritten digits (shipped with "
        "the package: nothing is downloaded) twice, once in full precision and once with memctl "
        "attached, serving memctl's HTTP API and dashboard while it runs. Prints a comparison table "
        "and writes report.json, a PNG plot of loss and memory and the run's event log (events.jsonl) "
        "to the output directory.",
    )
    demo.add_argument("--steps", type=int, default=300, help="training steps per run (default 300)")
    demo.add_argument("--batch-size", type=int, default=128, help="batch size (default 128)")
    demo.add_argument("--budget", default=None,
                      help="device-memory budget, e.g. '2GiB', '800MB' or '75%%' (default: none)")
    demo.add_argument("--bits", type=float, default=2.0,
                      help="average bits per compressed value without a budget (default 2)")
    demo.add_argument("--device", default="auto", help="'auto' (GPU if there is one), 'cpu' or 'cuda'")
    demo.add_argument("--port", type=int, default=0, help="API port (default 0: any free port)")
    demo.add_argument("--out", default="memctl-out", help="output directory (default ./memctl-out)")
    demo.add_argument("--no-baseline", action="store_true", help="skip the full-precision comparison run")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.add_argument("--tensorboard", default=None, metavar="DIR",
                      help="also write memctl's scalars to TensorBoard in DIR ('tensorboard' extra)")

    status = sub.add_parser("status", help="show a running job's compression and memory state",
                            description="Query GET /v1/stats of a running memctl job.")
    status.add_argument("--url", default=DEFAULT_URL, help=f"the job's API (default {DEFAULT_URL})")
    status.add_argument("--json", action="store_true", help="print the raw JSON")

    budget = sub.add_parser("budget", help="set a running job's memory budget",
                            description="PUT /v1/budget on a running memctl job; applies at its next step.")
    budget.add_argument("value", help="e.g. '10GiB', '800MB', '75%%', a number of bytes, or 'none'")
    budget.add_argument("--url", default=DEFAULT_URL, help=f"the job's API (default {DEFAULT_URL})")
    budget.add_argument("--token", default=None,
                        help="bearer token if the job requires one (default: $MEMCTL_TOKEN)")
    return parser


def _request(url: str, method: str = "GET", body: Any = None, token: str | None = None) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Accept", "application/json")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read().decode())


def _fail(msg: str) -> int:
    print(f"memctl: {msg}", file=sys.stderr)
    return 2


def _http_error(url: str, exc: Exception) -> int:
    if isinstance(exc, urllib.error.HTTPError):
        detail = exc.read().decode(errors="replace")
        return _fail(f"{url} answered {exc.code}: {detail}")
    return _fail(f"cannot reach {url} ({exc}); is a memctl job serving there? (see --url)")


def _status(args: argparse.Namespace) -> int:
    url = args.url.rstrip("/") + "/v1/stats"
    try:
        s = _request(url)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return _http_error(url, exc)
    if args.json:
        print(json.dumps(s, indent=2))
        return 0
    from memctl.controller.budget import format_bytes

    print(f"step {s.get('step')}  budget {s.get('budget') or 'none'}  batch size {s.get('batch_size')}")
    print(f"activations {format_bytes(s.get('raw_bytes', 0))} -> {format_bytes(s.get('packed_bytes', 0))} "
          f"({s.get('ratio', 0):.1f}x, {s.get('avg_bits', 0):.2f} bits/value), "
          f"fallbacks {s.get('fallbacks', 0)}")
    mem = s.get("memory") or {}
    if mem:
        print(f"device {mem.get('device')} ({mem.get('reader')}): used {format_bytes(mem.get('used_bytes'))} "
              f"of {format_bytes(mem.get('total_bytes'))}")
    return 0


def _budget(args: argparse.Namespace) -> int:
    value: Any = args.value
    if value.lower() in ("none", "null"):
        value = None
    elif value.isdigit():
        value = int(value)
    url = args.url.rstrip("/") + "/v1/budget"
    token = args.token or os.environ.get("MEMCTL_TOKEN")
    try:
        answer = _request(url, "PUT", {"target": value}, token)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return _http_error(url, exc)
    print(json.dumps(answer, indent=2))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from memctl._extras import require
    from memctl.controller.budget import parse_budget
    from memctl.demo import DemoOptions, run_demo
    from memctl.errors import BudgetError, MissingExtraError

    try:
        require("demo", "memctl demo")
        if args.tensorboard is not None:
            require("tensorboard", "memctl demo --tensorboard")
    except MissingExtraError as exc:
        return _fail(str(exc))
    if args.steps < 1:
        return _fail(f"--steps {args.steps}: must be at least 1")
    if args.batch_size < 1:
        return _fail(f"--batch-size {args.batch_size}: must be at least 1")
    try:
        parse_budget(args.budget)
    except BudgetError as exc:
        return _fail(str(exc))
    opts = DemoOptions(steps=args.steps, batch_size=args.batch_size, budget=args.budget, bits=args.bits,
                       device=args.device, port=args.port, out=args.out, baseline=not args.no_baseline,
                       progress=not args.no_progress, tensorboard=args.tensorboard)
    run_demo(opts)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    handlers = {"demo": _demo, "status": _status, "budget": _budget}
    return handlers[args.command](args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
