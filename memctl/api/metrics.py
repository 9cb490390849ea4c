"""Prometheus exposition: a collector that reads a :class:`ControllerView` at scrape time."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from memctl.api.view import ControllerView

__all__ = ["SnapshotCollector", "build_registry"]

# NOTE [ One registry per app, filled at scrape time ]
# prometheus_client's default REGISTRY is process-global: two apps (two controllers, two
# tests) would collide on metric names. Each app gets its own CollectorRegistry holding one
# custom collector that reads view.snapshot() when scraped, so metrics are never stale and
# the training thread does no Prometheus work at all.

# NOTE [ Metric names and unknown values ]
# Prometheus conventions: things that only go up are counters (``_total``: steps, events by
# kind, allocations, budget changes, codec fallbacks); fractions are 0-1 and end in
# ``_ratio`` (packed over raw activation bytes, device memory used); durations are
# seconds, and the controller's own work is histograms (``_seconds_bucket``/``_sum``/
# ``_count``: step overhead, encode, decode; NOTE [ What is timed, and what it costs ]).
# Values that are unknown (None, NaN) are left out rather than exported as NaN. Without
# a budget, ``memctl_budget_bytes`` and ``memctl_activation_budget_bytes`` are therefore
# absent, and ``memctl_budget_enabled`` (always present) is 0: a "budget" panel shows no
# line rather than a NaN or a misleading 0, and alerts can test ``memctl_budget_enabled``.

# (metric name, snapshot key, help text) for the plain gauges.
_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("memctl_activation_raw_bytes", "raw_bytes", "Saved activation bytes of the last step, uncompressed."),
    ("memctl_activation_packed_bytes", "packed_bytes", "Saved activation bytes of the last step, packed."),
    ("memctl_avg_bits", "avg_bits", "Average bits per saved activation value."),
    ("memctl_budget_bytes", "budget_bytes", "Device memory budget in force, in bytes (absent without one)."),
    ("memctl_activation_budget_bytes", "activation_budget_bytes",
     "Part of the budget left for activations (absent without a budget)."),
    ("memctl_batch_size", "batch_size", "Batch size in force."),
    ("memctl_world_size", "world_size", "Ranks in the controller's process group (1 without one)."),
    ("memctl_allocation_agreed", "agreed", "1 when every rank applies the same allocation and batch size."),
)
# (metric name, MemorySample key, help text) for the device gauges, labelled by device and reader.
_DEVICE_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("memctl_device_total_bytes", "total_bytes", "Device memory capacity."),
    ("memctl_device_used_bytes", "used_bytes", "Device memory in use by every process."),
    ("memctl_device_free_bytes", "free_bytes", "Device memory free."),
    ("memctl_process_device_bytes", "process_bytes", "This process's usage of the device."),
    ("memctl_torch_allocated_bytes", "allocated_bytes", "Bytes held by live tensors (PyTorch allocator)."),
    ("memctl_torch_reserved_bytes", "reserved_bytes", "Bytes reserved by PyTorch's caching allocator."),
)
# (metric name, layer key, help text) for the per-layer gauges, labelled by layer.
_LAYER_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("memctl_layer_bits", "bits", "Average bits of a layer's saved activations."),
    ("memctl_layer_error_bound", "error_bound", "Absolute error bound of a layer's saved activations."),
    ("memctl_layer_raw_bytes", "raw_bytes", "A layer's saved activation bytes uncompressed."),
    ("memctl_layer_packed_bytes", "packed_bytes", "A layer's saved activation bytes packed."),
    ("memctl_layer_sensitivity", "sensitivity", "A layer's gradient-variance weight (ActNN's C_l)."),
)
# (metric name, snapshot["timings"] key, help text) for the histograms.
_HISTOGRAMS: tuple[tuple[str, str, str], ...] = (
    ("memctl_step_overhead_seconds", "step",
     "memctl's work per training step: the step boundary plus that step's encode and decode."),
    ("memctl_codec_encode_seconds", "encode",
     "Time to compress one saved tensor, or one batch of small ones (pack hook)."),
    ("memctl_codec_decode_seconds", "decode",
     "Time to decompress one saved tensor, or one batch of small ones (unpack hook)."),
)
# Event kinds counted by their own counters besides memctl_events_total{kind}.
_ALLOCATION_KINDS = ("allocation", "budget_infeasible")
_BUDGET_KINDS = ("budget",)


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float) and not (isinstance(value, float) and math.isnan(value)):
        return float(value)
    return None


class SnapshotCollector(Collector):
    """Turns ``view.snapshot()`` into ``memctl_*`` metric families at each scrape."""

    def __init__(self, view: ControllerView) -> None:
        self._view = view

    def describe(self) -> list[Metric]:
        # Names depend on the snapshot; declaring none keeps registration from scraping.
        return []

    def collect(self) -> Iterator[Metric]:
        snap = self._view.snapshot()
        step = _number(snap.get("step"))
        if step is not None:
            yield CounterMetricFamily("memctl_steps", "Optimizer steps completed.", value=step)
        for name, key, doc in _GAUGES:
            value = _number(snap.get(key))
            if value is not None:
                yield GaugeMetricFamily(name, doc, value=value)
        yield GaugeMetricFamily("memctl_budget_enabled", "1 when a memory budget is set, else 0.",
                                value=float(snap.get("budget") is not None))
        raw, packed = _number(snap.get("raw_bytes")), _number(snap.get("packed_bytes"))
        if raw and packed is not None:
            yield GaugeMetricFamily("memctl_activation_packed_ratio",
                                    "Packed over raw saved-activation bytes of the last step (0-1).",
                                    value=packed / raw)
        fallbacks = _number(snap.get("fallbacks"))
        if fallbacks is not None:
            yield CounterMetricFamily(
                "memctl_codec_fallbacks", "Tensors kept uncompressed after a codec failed.", value=fallbacks
            )
        yield from _event_counters(snap.get("counters"))
        allocation = snap.get("allocation")
        if isinstance(allocation, Mapping):
            seconds = _number(allocation.get("time_ms"))
            if seconds is not None:
                yield GaugeMetricFamily("memctl_allocation_seconds", "Time the last bit allocation took.",
                                        value=seconds / 1000.0)
            objective = _number(allocation.get("objective"))
            if objective is not None:
                yield GaugeMetricFamily("memctl_allocation_objective",
                                        "Variance objective of the last allocation.", value=objective)
        yield from _histograms(snap.get("timings"))
        yield from _device_metrics(snap.get("memory"))
        yield from _layer_metrics(snap.get("layers") or [])


def _event_counters(counters: object) -> Iterator[Metric]:
    events = counters.get("events") if isinstance(counters, Mapping) else None
    counts = {str(k): n for k, v in (events or {}).items() if (n := _number(v)) is not None}
    family = CounterMetricFamily("memctl_events", "Controller events since attach, by kind.", labels=["kind"])
    for kind in sorted(counts):
        family.add_metric([kind], counts[kind])
    yield family
    yield CounterMetricFamily("memctl_allocations", "Bit allocations solved since attach.",
                              value=sum(counts.get(k, 0.0) for k in _ALLOCATION_KINDS))
    yield CounterMetricFamily("memctl_budget_changes", "Budget changes applied since attach.",
                              value=sum(counts.get(k, 0.0) for k in _BUDGET_KINDS))


def _histograms(timings: object) -> Iterator[Metric]:
    if not isinstance(timings, Mapping):
        return
    for name, key, doc in _HISTOGRAMS:
        hist = timings.get(key)
        if not isinstance(hist, Mapping):
            continue
        buckets = [(floatToGoString(bound), int(count)) for bound, count in hist.get("buckets", ())]
        if not buckets:
            continue
        yield HistogramMetricFamily(name, doc, buckets=buckets, sum_value=float(hist.get("sum", 0.0)))


def _device_metrics(memory: object) -> Iterator[Metric]:
    if not isinstance(memory, Mapping):
        return
    labels = [str(memory.get("device", "")), str(memory.get("reader", ""))]
    for name, key, doc in _DEVICE_GAUGES:
        value = _number(memory.get(key))
        if value is not None:
            family = GaugeMetricFamily(name, doc, labels=["device", "reader"])
            family.add_metric(labels, value)
            yield family
    used, total = _number(memory.get("used_bytes")), _number(memory.get("total_bytes"))
    if used is not None and total:
        family = GaugeMetricFamily("memctl_device_used_ratio", "Device memory in use over capacity (0-1).",
                                   labels=["device", "reader"])
        family.add_metric(labels, used / total)
        yield family
    utilization = _number(memory.get("utilization"))
    if utilization is not None:
        family = GaugeMetricFamily("memctl_device_utilization_ratio", "GPU utilisation (0-1).",
                                   labels=["device", "reader"])
        family.add_metric(labels, utilization / 100.0)
        yield family


def _layer_metrics(layers: list[Mapping[str, Any]]) -> Iterator[Metric]:
    for name, key, doc in _LAYER_GAUGES:
        family = GaugeMetricFamily(name, doc, labels=["layer"])
        for layer in layers:
            value = _number(layer.get(key))
            if value is not None:
                family.add_metric([str(layer.get("name", ""))], value)
        if family.samples:
            yield family


def build_registry(view: ControllerView, all_ranks: bool = False) -> CollectorRegistry:
    """A fresh registry holding one :class:`SnapshotCollector` over ``view``; with
    ``all_ranks`` the other ranks' rows of the aggregated view too (NOTE [ Per-rank series ])."""
    from memctl.api.ranks import RankLabels

    registry = CollectorRegistry(auto_describe=False)
    registry.register(RankLabels(SnapshotCollector(view), view, all_ranks))  # NOTE [ Per-rank series ]
    return registry
