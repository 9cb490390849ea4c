"""Prometheus exposition: a collector that reads a :class:`ControllerView` at scrape time."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from memctl.api.view import ControllerView

__all__ = ["SnapshotCollector", "build_registry"]

# NOTE [ One registry per app, filled at scrape time ]
# prometheus_client's default REGISTRY is process-global: two apps (two controllers, two
# tests) would collide on metric names. Each app gets its own CollectorRegistry holding one
# custom collector that reads view.snapshot() when scraped, so metrics are never stale and
# the training thread does no Prometheus work at all. Values that are unknown (None) are
# left out rather than exported as NaN.

# (metric name, snapshot key, help text) for the plain gauges.
_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("memctl_step", "step", "Optimizer steps completed."),
    ("memctl_activation_raw_bytes", "raw_bytes", "Saved activation bytes of the last step, uncompressed."),
    ("memctl_activation_packed_bytes", "packed_bytes", "Saved activation bytes of the last step, packed."),
    ("memctl_compression_ratio", "ratio", "Raw over packed activation bytes."),
    ("memctl_avg_bits", "avg_bits", "Average bits per saved activation value."),
    ("memctl_budget_bytes", "budget_bytes", "Device memory budget in force, in bytes."),
    ("memctl_activation_budget_bytes", "activation_budget_bytes", "Part of the budget left for activations."),
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
    ("memctl_device_utilization_percent", "utilization", "GPU utilisation in percent."),
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
        for name, key, doc in _GAUGES:
            value = _number(snap.get(key))
            if value is not None:
                yield GaugeMetricFamily(name, doc, value=value)
        fallbacks = _number(snap.get("fallbacks"))
        if fallbacks is not None:
            yield CounterMetricFamily(
                "memctl_codec_fallbacks", "Tensors kept uncompressed after a codec failed.", value=fallbacks
            )
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
        yield from _device_metrics(snap.get("memory"))
        yield from _layer_metrics(snap.get("layers") or [])


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


def _layer_metrics(layers: list[Mapping[str, Any]]) -> Iterator[Metric]:
    for name, key, doc in _LAYER_GAUGES:
        family = GaugeMetricFamily(name, doc, labels=["layer"])
        for layer in layers:
            value = _number(layer.get(key))
            if value is not None:
                family.add_metric([str(layer.get("name", ""))], value)
        if family.samples:
            yield family


def build_registry(view: ControllerView) -> CollectorRegistry:
    """A fresh registry holding one :class:`SnapshotCollector` over ``view``."""
    from memctl.api.ranks import RankLabels

    registry = CollectorRegistry(auto_describe=False)
    registry.register(RankLabels(SnapshotCollector(view), view))  # NOTE [ Per-rank series ]
    return registry
