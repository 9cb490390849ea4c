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
    assert value["memctl_step"] == 120
    assert value["memctl_activation_raw_bytes"] == 24 * 2**30
    assert value["memctl_activation_packed_bytes"] == 3 * 2**30
    assert value["memctl_compression_ratio"] == 8.0 and value["memctl_avg_bits"] == 4.0
    assert value["memctl_budget_bytes"] == 60 * 2**30 and value["memctl_batch_size"] == 256
    assert value["memctl_allocation_seconds"] == 0.0125
    assert fams["memctl_codec_fallbacks"] == [("memctl_codec_fallbacks_total", {}, 2.0)]
    assert fams["memctl_device_used_bytes"] == [
        ("memctl_device_used_bytes", {"device": "cuda:0", "reader": "nvml"}, 27 * 2**30)
    ]
    assert fams["memctl_device_total_bytes"][0][2] == 80 * 2**30
    assert fams["memctl_layer_bits"] == [("memctl_layer_bits", {"layer": "conv1"}, 2.0)]
    assert fams["memctl_layer_error_bound"] == [("memctl_layer_error_bound", {"layer": "blocks.0.fc"}, 0.01)]
    assert {s[1]["layer"]: s[2] for s in fams["memctl_layer_packed_bytes"]} == {
        "conv1": 2**31, "blocks.0.fc": 2**30
    }


def test_unknown_values_are_left_out(make_client: Callable[..., TestClient]) -> None:
    fams = _families(make_client(StaticView({"ratio": float("nan")})).get("/metrics").text)
    assert "memctl_step" in fams and "memctl_compression_ratio" not in fams
    for absent in ("memctl_budget_bytes", "memctl_batch_size", "memctl_device_used_bytes",
                   "memctl_layer_bits", "memctl_allocation_seconds"):
        assert absent not in fams


def test_metrics_are_read_at_scrape_time(make_client: Callable[..., TestClient]) -> None:
    view = StaticView()
    client = make_client(view)
    assert _families(client.get("/metrics").text)["memctl_step"][0][2] == 0
    view.publish(step=7)
    assert _families(client.get("/metrics").text)["memctl_step"][0][2] == 7


def test_registries_are_per_view() -> None:
    a, b = build_registry(StaticView({"step": 3})), build_registry(StaticView({"step": 4}))
    assert a.get_sample_value("memctl_step") == 3 and b.get_sample_value("memctl_step") == 4
    assert list(SnapshotCollector(StaticView()).describe()) == []


def test_a_rank_labels_every_series(make_client: Callable[..., TestClient]) -> None:
    client = make_client(StaticView({"step": 5, "rank": 1, "world_size": 2, "agreed": True,
                                     "layers": [{"name": "fc", "bits": 2.0}]}))
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    assert families["memctl_step"].samples[0].labels == {"rank": "1"}
    assert families["memctl_layer_bits"].samples[0].labels == {"layer": "fc", "rank": "1"}
    assert all(s.labels.get("rank") == "1" for f in families.values() for s in f.samples)
    assert client.get("/v1/stats").json()["world_size"] == 2
