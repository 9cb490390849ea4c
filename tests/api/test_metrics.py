from __future__ import annotations

from collections.abc import Callable

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from memctl.api import StaticView, build_registry
from memctl.api.metrics import SnapshotCollector


def _families(text: str) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    out: dict[str, list[tuple[str, dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        out[family.name] = [(s.name, dict(s.labels), s.value) for s in family.samples]
    return out


def test_metrics_parse_and_carry_the_snapshot(client: TestClient) -> None:
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    fams = _families(r.text)
    assert all(name.startswith("memctl_") for name in fams)
    value = {name: samples[0][2] for name, samples in fams.items() if len(samples) == 1}
    assert fams["memctl_steps"] == [("memctl_steps_total", {}, 120.0)]
    assert value["memctl_activation_raw_bytes"] == 24 * 2**30
    assert value["memctl_activation_packed_bytes"] == 3 * 2**30
    assert value["memctl_activation_packed_ratio"] == 0.125 and value["memctl_avg_bits"] == 4.0
    assert value["memctl_budget_enabled"] == 1.0
    assert value["memctl_budget_bytes"] == 60 * 2**30 and value["memctl_batch_size"] == 256
    assert value["memctl_allocation_seconds"] == 0.0125
    assert fams["memctl_codec_fallbacks"] == [("memctl_codec_fallbacks_total", {}, 2.0)]
    assert fams["memctl_device_used_bytes"] == [
        ("memctl_device_used_bytes", {"device": "cuda:0", "reader": "nvml"}, 27 * 2**30)
    ]
    assert fams["memctl_device_total_bytes"][0][2] == 80 * 2**30
    assert fams["memctl_device_used_ratio"][0][2] == 27 / 80
    assert fams["memctl_device_utilization_ratio"][0][2] == 0.87
    assert fams["memctl_layer_bits"] == [("memctl_layer_bits", {"layer": "conv1"}, 2.0)]
    assert fams["memctl_layer_error_bound"] == [("memctl_layer_error_bound", {"layer": "blocks.0.fc"}, 0.01)]
    assert {s[1]["layer"]: s[2] for s in fams["memctl_layer_packed_bytes"]} == {
        "conv1": 2**31, "blocks.0.fc": 2**30
    }


def test_unknown_values_are_left_out(make_client: Callable[..., TestClient]) -> None:
    text = make_client(StaticView({"avg_bits": float("nan")})).get("/metrics").text
    fams = _families(text)
    assert "memctl_steps" in fams and "memctl_avg_bits" not in fams
    assert "memctl_activation_packed_ratio" not in fams  # nothing saved yet: no ratio, not NaN
    for absent in ("memctl_budget_bytes", "memctl_activation_budget_bytes", "memctl_batch_size",
                   "memctl_device_used_bytes", "memctl_layer_bits", "memctl_allocation_seconds"):
        assert absent not in fams
    assert fams["memctl_budget_enabled"] == [("memctl_budget_enabled", {}, 0.0)]  # no budget: 0
    assert "NaN" not in text


def test_counters_are_counters_and_ratios_are_fractions(client: TestClient) -> None:
    types = {f.name: f.type for f in text_string_to_metric_families(client.get("/metrics").text)}
    for name in ("memctl_steps", "memctl_events", "memctl_allocations", "memctl_budget_changes",
                 "memctl_codec_fallbacks"):
        assert types[name] == "counter", name
    for name, kind in types.items():
        if name.endswith("_ratio"):
            assert kind == "gauge", name
    assert not any(name.endswith("_percent") for name in types)


def test_event_counters_and_histograms(make_client: Callable[..., TestClient]) -> None:
    timings = {
        "step": {"buckets": [[0.001, 1], [0.01, 3], [float("inf"), 4]], "sum": 0.5, "count": 4},
        "encode": {"buckets": [[0.001, 10], [float("inf"), 10]], "sum": 0.002, "count": 10},
    }
    view = StaticView({"counters": {"events": {"allocation": 3, "budget_infeasible": 1, "budget": 2,
                                                "attach": 1}},
                       "timings": timings})
    fams = _families(make_client(view).get("/metrics").text)
    assert {s[1]["kind"]: s[2] for s in fams["memctl_events"]} == {
        "allocation": 3, "budget_infeasible": 1, "budget": 2, "attach": 1
    }
    assert fams["memctl_allocations"] == [("memctl_allocations_total", {}, 4.0)]
    assert fams["memctl_budget_changes"] == [("memctl_budget_changes_total", {}, 2.0)]
    step = fams["memctl_step_overhead_seconds"]
    assert ("memctl_step_overhead_seconds_bucket", {"le": "0.01"}, 3.0) in step
    assert ("memctl_step_overhead_seconds_bucket", {"le": "+Inf"}, 4.0) in step
    assert ("memctl_step_overhead_seconds_count", {}, 4.0) in step
    assert ("memctl_step_overhead_seconds_sum", {}, 0.5) in step
    assert ("memctl_codec_encode_seconds_count", {}, 10.0) in fams["memctl_codec_encode_seconds"]
    assert "memctl_codec_decode_seconds" not in fams  # not measured: left out


def test_openmetrics_by_content_negotiation(client: TestClient) -> None:
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics

    r = client.get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/openmetrics-text")
    assert r.text.endswith("# EOF\n")
    fams = {f.name: f for f in parse_openmetrics(r.text)}
    assert fams["memctl_steps"].type == "counter"
    assert fams["memctl_steps"].samples[0].value == 120
    plain = client.get("/metrics", headers={"Accept": "text/plain"})
    assert plain.headers["content-type"].startswith("text/plain") and "# EOF" not in plain.text


def test_metrics_are_read_at_scrape_time(make_client: Callable[..., TestClient]) -> None:
    view = StaticView()
    client = make_client(view)
    assert _families(client.get("/metrics").text)["memctl_steps"][0][2] == 0
    view.publish(step=7)
    assert _families(client.get("/metrics").text)["memctl_steps"][0][2] == 7


def test_registries_are_per_view() -> None:
    a, b = build_registry(StaticView({"step": 3})), build_registry(StaticView({"step": 4}))
    assert a.get_sample_value("memctl_steps_total") == 3 and b.get_sample_value("memctl_steps_total") == 4
    assert list(SnapshotCollector(StaticView()).describe()) == []


def test_a_rank_labels_every_series(make_client: Callable[..., TestClient]) -> None:
    client = make_client(StaticView({"step": 5, "rank": 1, "world_size": 2, "agreed": True,
                                     "layers": [{"name": "fc", "bits": 2.0}]}))
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    assert families["memctl_steps"].samples[0].labels == {"rank": "1"}
    assert families["memctl_layer_bits"].samples[0].labels == {"layer": "fc", "rank": "1"}
    assert all(s.labels.get("rank") == "1" for f in families.values() for s in f.samples)
    assert client.get("/v1/stats").json()["world_size"] == 2
