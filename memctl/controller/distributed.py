"""Agreement across ``torch.distributed`` ranks: one allocation, one batch size, one budget.

NOTE [ Agreement across ranks ]
Under DDP or FSDP every rank runs its own controller over its own shard of the data, so
left alone each would solve its own allocation and batch size, and a budget changed over
one rank's HTTP API would change that rank only. With a process group (the default group
once ``init_process_group`` ran, or ``Controller(..., process_group=pg)``) the controllers
agree, with small ``all_reduce`` calls of one packed float64 tensor each, never one per
tensor, issued at the step boundary in the same order on every rank:

- every step, one MIN all-reduce (``world_size * 3 + 2`` values, plus four per layer on
  an allocation step) carries each rank's batch size (the smallest wins: a rank that must
  go lower takes every rank lower), the lowest rank with a queued ``load_state_dict``
  (NOTE [ Leaving the agreement ]), each rank's pending budget change in its own slot (the
  other slots hold +inf, so the MIN is an all-gather), and after a re-solve each layer's
  bits and error bound with their negations (so MIN yields both the minimum and maximum);
  every rank adopts the minimum bits, which is never more memory than any rank's own answer;
- at an allocation step, before solving, a MIN all-reduce of eight values (plus each
  rank's row of the aggregated view) checks that the ranks' layer tables agree (count,
  CRC of the names and of the saved-tensor counts), then one SUM all-reduce (mean ‖∇Y‖²
  and mean group-range term per layer: the averaged gradient's added variance is the mean
  of the ranks') and one MAX all-reduce (saved sizes, masks, fixed bytes, batch, static
  memory: the rank with the most must fit) replace each rank's statistics, so every rank
  solves the same problem.

A budget change queued on any rank travels in the next step's exchange and is applied at
the following step boundary on every rank: the same step everywhere, one step later than
without a process group. Changes that reach several ranks in the same step resolve to the
highest rank's. Cost: one all-reduce of a few hundred bytes per step (on NCCL a device
round trip of some tens of microseconds), three more at each allocation step.

If the layer tables differ (a rank ran code the others did not), the ranks solve from their
own statistics, ``stats()["agreed"]`` is False and an event says so; the batch size and
budget still agree. With the CPU's Gloo backend the tensors are on the CPU; with NCCL alone
on the current CUDA device.

The same collectives carry two more things, with no collective added: each rank's row of
the aggregated view in its slot of the layout check (NOTE [ Aggregated view ] in
``rank_summary.py``), and the calibration probes' measurements, guard floors and loss
signal in the SUM and MAX all-reduces (NOTE [ Calibration across ranks ] in
``probe_share.py``).

NOTE [ Leaving the agreement ]
The collectives above are matched by order: a rank that stops issuing them (a lone
``detach()``) or issues different ones (a lone ``load_state_dict``, which moves its step
and so its allocation steps) would leave the others blocked in an all-reduce until the
backend's timeout (30 minutes by default). So neither acts on its own:

- ``detach()`` under a group removes every model hook at once (the model is plain PyTorch
  again), but keeps the optimizer's step post-hook for one more step: at that step's
  boundary the rank issues the collective the others issue there (the layout check on an
  allocation step, the per-step exchange otherwise), marked "left" in its own slot, and
  then removes the hook. When every rank detached, every rank leaves there and nothing
  is left waiting. When only some did, the others read the mark, record an ``error``
  event and a warning that say which ranks left and the fix (``detach()`` is collective:
  call it on every rank between the same two optimizer steps), and go on without
  agreeing (``agreed`` False) rather than wait; training is not interrupted. Without an
  optimizer, call :meth:`Controller.step` once more after ``detach()``. A rank that
  detaches and never steps again (it stopped training) still leaves the others waiting,
  as any stopped rank does (DDP's own gradient all-reduce would wait for it too).
- ``load_state_dict`` under a group checks the state at once (a bad state raises on the
  rank that loads it) and queues it; the per-step exchange carries the lowest rank with a
  queued state, which broadcasts it (``broadcast_object_list``, only on such a step), and
  every rank applies that same state at the end of the same step boundary. A state loaded
  on rank 0 alone resumes every rank; states loaded on several ranks resolve to the
  lowest rank's.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
import zlib
from typing import Any

import torch

from memctl.controller.budget import BudgetSpec, parse_budget
from memctl.controller.rank_summary import FIELDS, LEFT, decode_rows, encode_row, this_rank
from memctl.errors import ConfigError

# The functions below read and set the controller's step-boundary state; they take it as
# ``Any`` (``Controller``), as importing controller.py here would make an import cycle.
Controller = Any

__all__ = ["RankSync", "local_rank", "rank_info", "resolve_group"]

_INF = float("inf")
_SLOT = 3  # has_change (1; -1: this rank leaves), kind (0: none, 1: bytes, 2: fraction), value
_CHECK = 8  # values of the layout check before the rows of the aggregated view
_log = logging.getLogger("memctl.controller")


def local_rank() -> int:
    """This process's rank on its node: torchrun's ``LOCAL_RANK``, else 0."""
    try:
        return max(0, int(os.environ.get("LOCAL_RANK", "0")))
    except ValueError:
        return 0


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def resolve_group(process_group: object) -> Any | None:
    """The process group to agree over: ``process_group`` or, when None, the default group
    once ``torch.distributed`` is initialised; None when there is nothing to agree with."""
    if not torch.distributed.is_available():
        if process_group is not None:
            raise ConfigError("process_group was given but this torch has no torch.distributed")
        return None
    dist = _dist()
    if process_group is None:
        if not dist.is_initialized():
            return None
        return dist.group.WORLD
    if not isinstance(process_group, dist.ProcessGroup):
        raise ConfigError(
            "process_group must be a torch.distributed.ProcessGroup or None, got "
            f"{type(process_group).__name__}; pass the group from dist.new_group(...) or leave it "
            "out to use the default group"
        )
    return process_group


def rank_info(sync: RankSync | None) -> dict[str, Any]:
    """The ``rank``, ``world_size`` and ``agreed`` keys of the controller's snapshot."""
    if sync is not None:
        return {"rank": sync.rank, "world_size": sync.world_size, "agreed": sync.agreed}
    if torch.distributed.is_available():
        dist = _dist()
        if dist.is_initialized():
            world = dist.get_world_size()
            return {"rank": dist.get_rank(), "world_size": world, "agreed": world == 1}
    return {"rank": 0, "world_size": 1, "agreed": True}


class RankSync:
    """One controller's side of NOTE [ Agreement across ranks ]."""

    def __init__(self, group: Any) -> None:
        dist = _dist()
        self._group = group
        self.rank = int(dist.get_rank(group))
        self.world_size = int(dist.get_world_size(group))
        self.device = _collective_device(group)
        self.agreed = True
        self.collectives = 0
        self.collective_s = 0.0  # wall time spent in this controller's all-reduces
        self._sent = 0
        self._winner: tuple[bool, BudgetSpec | None, int] | None = None
        self._layout: list[str] | None = None
        self.rows: list[dict[str, Any]] = []
        """Every rank's row of the aggregated view, from the last allocation step."""
        self.left = False
        """Whether this controller stopped agreeing (NOTE [ Leaving the agreement ])."""
        self._load: dict[str, Any] | None = None
        self._incoming: tuple[int, Any] | None = None

    # -- budget ---------------------------------------------------------------------------
    @property
    def budget_pending(self) -> bool:
        """Whether the last exchange agreed on a budget change (the next boundary applies it)."""
        return self._winner is not None

    def apply_budget(self, ctl: Controller) -> bool:
        """Apply the change the last exchange agreed on (start of the boundary); True if one."""
        winner, self._winner = self._winner, None
        with ctl._lock:
            del ctl._pending[: self._sent]
        self._sent = 0
        if winner is None:
            return False
        _, spec, source = winner
        ctl._budget_spec = spec
        ctl._event("budget", f"budget set to {ctl._budget_text()} at step {ctl._step} "
                   f"(requested on rank {source}, applied on all {self.world_size} ranks)")
        return True

    # -- statistics ----------------------------------------------------------------------
    def reduce_statistics(self, ctl: Controller, share: Any = None) -> bool:
        """Replace the statistics that feed the allocation by their reduction over ranks.

        ``share`` (a :class:`~memctl.controller.probe_share.ProbeShare`) travels in the
        same SUM and MAX all-reduces and receives their result. Returns False when no rank
        saved anything the allocation controls (every rank then skips the re-solve alike),
        or when a rank left (then ``left`` is True).
        """
        names = sorted(ctl._layers)
        states = [ctl._layers[n] for n in names]
        counts = ",".join(str(len(s.numels)) for s in states)
        has_layers = float(any(s.numels for s in states))
        name_crc = float(zlib.crc32("\0".join(names).encode()))
        count_crc = float(zlib.crc32(counts.encode()))
        head = [float(len(names)), name_crc, count_crc]
        check = self._all_reduce([*head, *(-v for v in head), -has_layers, has_layers,
                                  *self._row_slots(encode_row(this_rank(ctl)))], "min")
        rows, left = decode_rows(check[_CHECK:], self.world_size)
        if left:
            self._others_left(ctl, left)
            return False
        self.rows = rows
        if not check[6] < 0:  # max(has_layers) == 0: nobody saved controlled tensors
            return False
        if check[:3] != [-v for v in check[3:6]]:
            self._layout = None
            self.agreed = False
            ctl._event("ranks", f"layer tables differ across ranks at step {ctl._step}; "
                       "this rank solves from its own statistics")
            if share is not None:
                share.keep_local()
            return True
        self._layout = names
        sums: list[float] = []
        maxima: list[float] = []
        for s in states:
            sums += [s.ema_grad_sq or 0.0, float(s.ema_grad_sq is not None),
                     s.ema_range_term or 0.0, float(s.ema_range_term is not None)]
            maxima += [float(s.mask_bytes), float(s.fixed_bytes), float(s.other_bytes), float(s.batch),
                       float(s.element_size), *(float(n) for n in s.numels)]
        maxima += [float(ctl._static_bytes), float(ctl._totals.get("batch", 0))]
        n_sums, n_maxima = len(sums), len(maxima)
        if share is not None:
            sums += share.sums()
            maxima += share.maxima()
        total, biggest = self._all_reduce_pair(sums, maxima)
        if share is not None:
            share.receive(total[n_sums:], biggest[n_maxima:])
        at = 0
        for i, s in enumerate(states):
            g2, g2_n, rng, rng_n = total[4 * i: 4 * i + 4]
            s.ema_grad_sq = g2 / g2_n if g2_n else None
            s.ema_range_term = rng / rng_n if rng_n else None
            s.mask_bytes, s.fixed_bytes, s.other_bytes, s.batch, s.element_size = (
                int(v) for v in biggest[at: at + 5])
            at += 5
            s.numels = tuple(int(v) for v in biggest[at: at + len(s.numels)])
            at += len(s.numels)
        ctl._static_bytes = int(biggest[at])
        ctl._totals["batch"] = int(biggest[at + 1])
        return True

    # -- the per-step exchange -----------------------------------------------------------
    def end_step(self, ctl: Controller, solved: bool) -> None:
        """The per-step MIN exchange: batch size, pending budget changes, the solved bits."""
        batch = ctl._batch_size
        values = [float(batch) if batch is not None else _INF,
                  float(self.rank) if self._load is not None else _INF]
        slots = [_INF] * (self.world_size * _SLOT)
        with ctl._lock:
            self._sent = len(ctl._pending)
            spec = ctl._pending[-1] if ctl._pending else None
        if self._sent:
            slots[self.rank * _SLOT: (self.rank + 1) * _SLOT] = _encode(spec)
        values += slots
        layout = self._layout if solved else None
        if layout is not None:
            for name in layout:
                s = ctl._layers[name]
                b = s.bits if s.bits is not None else -1.0
                e = s.error_bound if s.error_bound is not None else -1.0
                values += [b, -b, e, -e]
        out = self._all_reduce(values, "min")
        left = [r for r in range(self.world_size) if out[2 + r * _SLOT] == -1.0]
        if left:
            self._others_left(ctl, left)
            return
        ctl._batch_size = None if out[0] == _INF else int(out[0])
        self._winner = _decode_winner(out[2: 2 + len(slots)], self.world_size)
        if layout is not None:
            agreed = True
            base = 2 + len(slots)
            for i, name in enumerate(layout):
                b_min, b_max, e_min, e_max = out[base + 4 * i: base + 4 * i + 4]
                b_max, e_max = -b_max, -e_max
                agreed &= b_min == b_max and e_min == e_max
                s = ctl._layers[name]
                s.bits = None if b_min < 0 else b_min
                s.error_bound = None if e_min < 0 else e_min
            self.agreed = agreed
            if not agreed:
                ctl._event("ranks", f"ranks solved different allocations at step {ctl._step}; "
                           "all apply the lowest bits of each layer")
        elif solved:
            self.agreed = False
        if out[1] != _INF:
            self._receive_state(ctl, int(out[1]))

    # -- leaving, and loading a state (NOTE [ Leaving the agreement ]) --------------------
    def queue_load(self, state: dict[str, Any]) -> None:
        """Queue a checked state: the next exchange decides which rank's every rank applies."""
        self._load = state

    def _receive_state(self, ctl: Controller, source: int) -> None:
        holder = [self._load if source == self.rank else None]
        dist = _dist()
        start = time.perf_counter()
        dist.broadcast_object_list(holder, group=self._group, group_src=source)
        self.collectives += 1
        self.collective_s += time.perf_counter() - start
        mine, self._load = self._load, None
        if mine is not None and source != self.rank:
            ctl._event("load_state", f"the state loaded on this rank was replaced by rank {source}'s "
                       "(the lowest rank that loaded one wins)")
        self._incoming = (source, holder[0])

    def apply_loaded(self, ctl: Controller) -> None:
        """Apply the state the last exchange broadcast (the end of the boundary, every rank alike)."""
        incoming, self._incoming = self._incoming, None
        if incoming is None or not isinstance(incoming[1], dict):
            return
        source, state = incoming
        ctl._apply_state(ctl._checked_state(state))
        ctl._event("load_state", f"rank {source}'s state applied on all {self.world_size} ranks "
                   f"at step {ctl._step}")

    def leave(self, ctl: Controller, due: bool) -> None:
        """Issue the collective the other ranks issue at this boundary, marked "left"."""
        if due:
            row = [LEFT] + [_INF] * (len(FIELDS) - 1)
            self._all_reduce([_INF] * _CHECK + self._row_slots(row), "min")
        else:
            slots = [_INF] * (self.world_size * _SLOT)
            slots[self.rank * _SLOT] = -1.0
            self._all_reduce([_INF, _INF, *slots], "min")
        self.left = True
        self.agreed = False

    def _others_left(self, ctl: Controller, ranks: list[int]) -> None:
        self.left = True
        self.agreed = False
        ctl._errors += 1
        msg = (f"rank(s) {ranks} of {self.world_size} called Controller.detach() alone and left the "
               f"agreement at step {ctl._step}; this rank goes on without agreeing with the others on "
               "the allocation, batch size and budget. Under a process group detach() is collective: "
               "call it on every rank between the same two optimizer steps")
        _log.error("memctl: %s", msg)
        ctl._event("error", msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=2)

    def _row_slots(self, row: list[float]) -> list[float]:
        slots = [_INF] * (self.world_size * len(row))
        slots[self.rank * len(row): (self.rank + 1) * len(row)] = row
        return slots

    # -- collectives ---------------------------------------------------------------------
    def _all_reduce(self, values: list[float], op: str) -> list[float]:
        dist = _dist()
        start = time.perf_counter()
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=_op(op), group=self._group)
        out = [float(v) for v in t.cpu().tolist()]
        self.collectives += 1
        self.collective_s += time.perf_counter() - start
        return out

    def _all_reduce_pair(self, sums: list[float], maxima: list[float]) -> tuple[list[float], list[float]]:
        dist = _dist()
        start = time.perf_counter()
        a = torch.tensor(sums or [0.0], dtype=torch.float64, device=self.device)
        b = torch.tensor(maxima, dtype=torch.float64, device=self.device)
        wa = dist.all_reduce(a, op=_op("sum"), group=self._group, async_op=True)
        wb = dist.all_reduce(b, op=_op("max"), group=self._group, async_op=True)
        wa.wait()
        wb.wait()
        out = a.cpu().tolist(), b.cpu().tolist()
        self.collectives += 2
        self.collective_s += time.perf_counter() - start
        return out


def _op(name: str) -> Any:
    ops = _dist().ReduceOp
    return {"min": ops.MIN, "max": ops.MAX, "sum": ops.SUM}[name]


def _collective_device(group: Any) -> torch.device:
    backend = str(_dist().get_backend(group)).lower()
    if "gloo" in backend or "mpi" in backend or "nccl" not in backend:
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _encode(spec: BudgetSpec | None) -> list[float]:
    if spec is None:
        return [1.0, 0.0, 0.0]
    if spec.nbytes is not None:
        return [1.0, 1.0, float(spec.nbytes)]
    return [1.0, 2.0, float(spec.fraction or 0.0)]


def _decode_winner(slots: list[float], world: int) -> tuple[bool, BudgetSpec | None, int] | None:
    """The highest rank's change, if any rank sent one."""
    for rank in reversed(range(world)):
        has, kind, value = slots[rank * _SLOT: (rank + 1) * _SLOT]
        if has != 1.0:
            continue
        if kind == 1.0:
            return True, parse_budget(int(value)), rank
        if kind == 2.0:
            return True, BudgetSpec(fraction=value, text=f"{value * 100:g}%"), rank
        return True, None, rank
    return None
