"""A ``rank`` label on every metric of a rank's controller.

NOTE [ Per-rank series ]
Under torchrun every rank serves its own API (``serve(port=base, port_per_rank=True)``
binds ``base + LOCAL_RANK``) and Prometheus scrapes each as its own target. The ranks'
series must stay apart even when the scrape configuration does not relabel them, so a
controller that knows its rank (``snapshot()["rank"]``) labels every sample with it;
dashboards then show one series per rank and aggregate with ``max by`` / ``sum by``.
A view without a rank (a :class:`~memctl.api.view.StaticView` in tests) is unchanged.

With ``all_ranks=True`` (``/metrics?ranks=all``) the rows of the aggregated view (NOTE
[ Aggregated view ] in ``memctl/controller/rank_summary.py``) add the other ranks'
samples to the families they map to (steps, activation bytes, bits, budget, batch size,
agreement, fallbacks), each with its ``rank`` label, plus ``memctl_rank_report_step``,
``memctl_rank_process_bytes`` and ``memctl_rank_device_used_bytes`` for every rank's
row. Meant for one scrape of rank 0 instead of one per rank: scraping both ways would
count the other ranks twice (under two ``instance`` labels).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from memctl.api.view import ControllerView

__all__ = ["RankLabels", "rank_rows"]

# (family name, row key, counter?, help) of the other ranks' samples in /metrics?ranks=all.
_ROW_FAMILIES: tuple[tuple[str, str, bool, str], ...] = (
    ("memctl_steps", "step", True, "Optimizer steps completed."),
    ("memctl_activation_raw_bytes", "raw_bytes", False,
     "Saved activation bytes of the last step, uncompressed."),
    ("memctl_activation_packed_bytes", "packed_bytes", False,
     "Saved activation bytes of the last step, packed."),
    ("memctl_avg_bits", "avg_bits", False, "Average bits per saved activation value."),
    ("memctl_budget_bytes", "budget_bytes", False,
     "Device memory budget in force, in bytes (absent without one)."),
    ("memctl_activation_budget_bytes", "activation_budget_bytes", False,
     "Part of the budget left for activations (absent without a budget)."),
    ("memctl_batch_size", "batch_size", False, "Batch size in force."),
    ("memctl_allocation_agreed", "agreed", False,
     "1 when every rank applies the same allocation and batch size."),
    ("memctl_codec_fallbacks", "fallbacks", True, "Tensors kept uncompressed after a codec failed."),
)
# Families only the aggregated view has, one sample per rank's row (its own included).
_ROW_ONLY: tuple[tuple[str, str, str], ...] = (
    ("memctl_rank_report_step", "step", "Step at which the rank's row of the aggregated view was taken."),
    ("memctl_rank_process_bytes", "process_bytes", "The rank's own device usage at its last row."),
    ("memctl_rank_device_used_bytes", "device_used_bytes", "Its device's usage by every process at its row."),
)


def rank_rows(snapshot: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The aggregated view's rows: the snapshot's ``ranks``, or one row made from the snapshot."""
    rows = [dict(r) for r in snapshot.get("ranks") or []]
    if rows:
        return rows
    sample = snapshot.get("memory")
    memory: Mapping[str, Any] = sample if isinstance(sample, Mapping) else {}
    keys = ("step", "raw_bytes", "packed_bytes", "other_bytes", "ratio", "avg_bits", "batch_size",
            "budget_bytes", "activation_budget_bytes", "static_bytes", "fallbacks", "agreed")
    return [{
        "rank": snapshot.get("rank") or 0,
        **{k: snapshot.get(k) for k in keys},
        "errors": snapshot.get("errors", 0),
        "process_bytes": memory.get("process_bytes"),
        "device_used_bytes": memory.get("used_bytes"),
    }]


class RankLabels(Collector):
    """Re-emits ``inner``'s metric families with ``rank="<n>"`` added to every sample."""

    def __init__(self, inner: Collector, view: ControllerView, all_ranks: bool = False) -> None:
        self._inner = inner
        self._view = view
        self._all_ranks = all_ranks

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        rank = self._view.snapshot().get("rank")
        families = self._inner.collect()
        if not isinstance(rank, int) or isinstance(rank, bool):
            yield from families
            return
        label = str(rank)
        rows = [r for r in rank_rows(self._view.snapshot()) if r.get("rank") != rank] \
            if self._all_ranks else []
        by_name = {name: (key, counter) for name, key, counter, _ in _ROW_FAMILIES}
        seen: set[str] = set()
        for family in families:
            labelled = Metric(family.name, family.documentation, family.type, family.unit)
            labelled.samples = [s._replace(labels={**s.labels, "rank": label}) for s in family.samples]
            if family.name in by_name and labelled.samples:
                seen.add(family.name)
                key, _ = by_name[family.name]
                template = labelled.samples[0]
                labelled.samples += [Sample(template.name, {"rank": str(r["rank"])}, float(r[key]))
                                     for r in rows if _known(r.get(key))]
            yield labelled
        for name, key, counter, doc in _ROW_FAMILIES:
            if name in seen or not any(_known(r.get(key)) for r in rows):
                continue
            extra = (CounterMetricFamily if counter else GaugeMetricFamily)(name, doc, labels=["rank"])
            for r in rows:
                if _known(r.get(key)):
                    extra.add_metric([str(r["rank"])], float(r[key]))
            yield extra
        if self._all_ranks:
            everyone = rank_rows(self._view.snapshot())
            for name, key, doc in _ROW_ONLY:
                only = GaugeMetricFamily(name, doc, labels=["rank"])
                for r in everyone:
                    if _known(r.get(key)):
                        only.add_metric([str(r["rank"])], float(r[key]))
                if only.samples:
                    yield only


def _known(value: object) -> bool:
    return isinstance(value, int | float) and value == value
