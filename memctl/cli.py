"""The ``memctl`` command line: ``demo``, ``status`` and ``budget``."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from memctl._version import __version__

__all__ = ["build_parser", "main"]

DEFAULT_URL = "http://127.0.0.1:8765"
# argparse reads "-5GiB" as an unknown option; main() passes such a budget through this
# hidden option instead, so that it is parsed (and refused) like any other value.
_VALUE_OPTION = "--budget-value"
_NEGATIVE = re.compile(r"^-[0-9.]")


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
    demo.add_argument("--warmup-steps", type=int, default=0,
                      help="the memctl run's first N steps at 8 bits (default 0: none)")
    demo.add_argument("--device", default="auto", help="'auto' (GPU if there is one), 'cpu' or 'cuda'")
    demo.add_argument("--port", type=int, default=0, help="API port (default 0: any free port)")
    demo.add_argument("--out", default="memctl-out", help="output directory (default ./memctl-out)")
    demo.add_argument("--no-baseline", action="store_true", help="skip the full-precision comparison run")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.add_argument("--tensorboard", default=None, metavar="DIR",
                      help="also write memctl's scalars to TensorBoard in DIR ('tensorboard' extra)")
    # memctl.demo.LR_SCHEDULES, spelled out: importing memctl.demo imports torch (test_cli checks both)
    demo.add_argument("--lr-schedule", choices=("cosine", "constant"), default="cosine",
                      help="the learning rate: 'cosine' decays it from 2e-3 to 0 over the run "
                      "(default), 'constant' keeps it at 2e-3")

    status = sub.add_parser("status", help="show a running job's compression and memory state",
                            description="Query GET /v1/stats of a running memctl job.")
    status.add_argument("--url", default=DEFAULT_URL, help=f"the job's API (default {DEFAULT_URL})")
    status.add_argument("--json", action="store_true", help="print the raw JSON")
    status.add_argument("--token", default=None,
                        help="bearer token if the job requires one for reads (default: $MEMCTL_TOKEN)")

    budget = sub.add_parser("budget", help="set a running job's memory budget",
                            description="PUT /v1/budget on a running memctl job; applies at its next step.")
    budget.add_argument("value", nargs="?", default=None,
                        help="e.g. '10GiB', '800MB', '75%%', a number of bytes, or 'none'")
    budget.add_argument(_VALUE_OPTION, dest="value_option", default=None, help=argparse.SUPPRESS)
    budget.add_argument("--url", default=DEFAULT_URL, help=f"the job's API (default {DEFAULT_URL})")
    budget.add_argument("--token", default=None,
                        help="bearer token if the job requires one (default: $MEMCTL_TOKEN)")
    budget.add_argument("--json", action="store_true", help="print the server's JSON answer")
    return parser


def _base_url(url: str) -> str:
    """``url`` with a scheme (``localhost:8765`` means ``http://localhost:8765``), no trailing slash."""
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    scheme = url.split("://", 1)[0].lower()
    if scheme not in ("http", "https"):
        raise ValueError(f"--url {url!r}: use an http:// or https:// address, e.g. {DEFAULT_URL}")
    return url.rstrip("/")


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


_HINTS = {
    401: " (pass --token, or set MEMCTL_TOKEN to the job's token)",
    403: " (check --token or MEMCTL_TOKEN)",
    421: " (use a host name the job serves, e.g. 127.0.0.1)",
}


def _http_error(url: str, exc: Exception) -> int:
    if isinstance(exc, urllib.error.HTTPError):
        raw = exc.read().decode(errors="replace")
        try:
            detail = json.loads(raw).get("detail", raw)
        except (ValueError, AttributeError):
            detail = raw
        detail = str(detail).strip().rstrip(".") or (exc.reason or "no detail")
        return _fail(f"the job at {url} refused the request ({exc.code}): {detail}{_HINTS.get(exc.code, '')}")
    reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    return _fail(f"cannot reach {url} ({reason}); is a memctl job serving there? (see --url)")


def _size(n: Any) -> str:
    from memctl.controller.budget import format_bytes

    return format_bytes(n) if isinstance(n, int | float) and not isinstance(n, bool) else "n/a"


def _status_lines(s: dict[str, Any]) -> list[str]:
    """``memctl status``'s summary of a /v1/stats body: the budget's split as README "What the
    budget counts" describes it, then the activations of the last step, then the device."""
    budget, total = s.get("budget"), s.get("budget_bytes")
    static = int(s.get("static_bytes") or 0)
    held = int(s.get("packed_bytes") or 0) + int(s.get("other_bytes") or 0)
    act_budget = s.get("activation_budget_bytes")
    shown = "none" if budget is None else (f"{_size(total)} ('{budget}')" if isinstance(budget, str)
                                             else _size(total))
    lines = [f"step {s.get('step')}  budget {shown}  batch size {s.get('batch_size') or 'n/a'}"]
    if total is not None and act_budget is not None:
        margin = max(int(total) - static - int(act_budget), 0)
        lines.append(f"budget split: static {_size(static)} (parameters, gradients, buffers, "
                     f"optimizer state) + activations up to {_size(act_budget)} + margin {_size(margin)}")
    else:
        lines.append(f"static {_size(static)} (parameters, gradients, buffers, optimizer state)")
    lines.append(
        f"activations held {_size(held)}: compressed {_size(s.get('raw_bytes', 0))} -> "
        f"{_size(s.get('packed_bytes', 0))} ({float(s.get('ratio') or 0):.1f}x, "
        f"{float(s.get('avg_bits') or 0):.2f} bits/value) + kept exact {_size(s.get('other_bytes', 0))}; "
        f"fallbacks {s.get('fallbacks', 0)}"
    )
    lines.append(f"counted against the budget: {_size(static + held)} "
                 "(not counted: the CUDA context, other processes, allocator cache)")
    mem = s.get("memory") or {}
    if mem:
        lines.append(f"device {mem.get('device')} ({mem.get('reader')}): used {_size(mem.get('used_bytes'))} "
                     f"of {_size(mem.get('total_bytes'))}")
    return lines


def _status(args: argparse.Namespace) -> int:
    try:
        url = _base_url(args.url) + "/v1/stats"
    except ValueError as exc:
        return _fail(str(exc))
    try:
        s = _request(url, token=args.token or os.environ.get("MEMCTL_TOKEN"))
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return _http_error(url, exc)
    if args.json:
        print(json.dumps(s, indent=2))
        return 0
    print("\n".join(_status_lines(s)))
    return 0


def _budget(args: argparse.Namespace) -> int:
    from memctl.controller.budget import format_bytes, parse_budget
    from memctl.errors import BudgetError

    text = args.value if args.value is not None else args.value_option
    if text is None or (args.value is not None and args.value_option is not None):
        return _fail("give one budget, e.g. 'memctl budget 10GiB' (or 'none' for no limit)")
    value: Any = text
    if text.strip().lower() in ("none", "null"):
        value = None
    else:
        try:
            parse_budget(text)
        except BudgetError as exc:
            return _fail(str(exc))
        if text.strip().isdigit():
            value = int(text)
    try:
        url = _base_url(args.url) + "/v1/budget"
    except ValueError as exc:
        return _fail(str(exc))
    token = args.token or os.environ.get("MEMCTL_TOKEN")
    try:
        answer = _request(url, "PUT", {"target": value}, token)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return _http_error(url, exc)
    if args.json:
        print(json.dumps(answer, indent=2))
        return 0
    target = "no limit" if answer.get("target") is None else format_bytes(answer.get("target_bytes"))
    print(f"budget {target} ({answer.get('target')!r}) queued; "
          f"it applies at step {answer.get('applies_at_step')}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from memctl._extras import require
    from memctl.demo import DemoOptions, check_options, run_demo
    from memctl.errors import MemctlError, MissingExtraError

    try:
        require("demo", "memctl demo")
        if args.tensorboard is not None:
            require("tensorboard", "memctl demo --tensorboard")
    except MissingExtraError as exc:
        return _fail(str(exc))
    opts = DemoOptions(steps=args.steps, batch_size=args.batch_size, budget=args.budget, bits=args.bits,
                       device=args.device, port=args.port, out=args.out, baseline=not args.no_baseline,
                       progress=not args.no_progress, tensorboard=args.tensorboard,
                       lr_schedule=args.lr_schedule, warmup_steps=args.warmup_steps)
    try:
        check_options(opts)  # everything, before minutes of training
        run_demo(opts)
    except MemctlError as exc:
        return _fail(str(exc))
    return 0


def _negative_budget(argv: Sequence[str]) -> list[str]:
    """``argv`` with a budget value that looks like an option (``-5GiB``) passed through
    :data:`_VALUE_OPTION`, so that it reaches the budget parser (and its message)."""
    args = list(argv)
    if "budget" not in args:
        return args
    start = args.index("budget") + 1
    for i in range(start, len(args)):
        if args[i] == "--":
            break
        takes_value = args[i - 1] in ("--url", "--token") and i - 1 >= start
        if _NEGATIVE.match(args[i]) and not takes_value:
            args[i] = f"{_VALUE_OPTION}={args[i]}"
    return args


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(_negative_budget(sys.argv[1:] if argv is None else argv))
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    handlers = {"demo": _demo, "status": _status, "budget": _budget}
    return handlers[args.command](args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
