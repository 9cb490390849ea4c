"""A ``rank`` label on every metric of a rank's controller.

NOTE [ Per-rank series ]
Under torchrun every rank serves its own API (``serve(port=base, port_per_rank=True)``
binds ``base + LOCAL_RANK``) and Prometheus scrapes each as its own target. The ranks'
series must stay apart even when the scrape configuration does not relabel them, so a
controller that knows its rank (``snapshot()["rank"]``) labels every sample with it;
dashboards then show one series per rank and aggregate with ``max by`` / ``sum by``.
A view without a rank (a :class:`~memctl.api.view.StaticView` in tests) is unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from memctl.api.view import ControllerView

__all__ = ["RankLabels"]


class RankLabels(Collector):
    """Re-emits ``inner``'s metric families with ``rank="<n>"`` added to every sample."""

    def __init__(self, inner: Collector, view: ControllerView) -> None:
        self._inner = inner
        self._view = view

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        rank = self._view.snapshot().get("rank")
        families = self._inner.collect()
        if not isinstance(rank, int) or isinstance(rank, bool):
            yield from families
            return
        label = str(rank)
        for family in families:
            labelled = Metric(family.name, family.documentation, family.type, family.unit)
            labelled.samples = [s._replace(labels={**s.labels, "rank": label}) for s in family.samples]
            yield labelled
