from __future__ import annotations

import dataclasses

import pytest

from memctl.errors import ConfigError
from memctl.monitor import MemorySample, ReaderKind


def _sample(**changes: object) -> MemorySample:
    fields: dict[str, object] = dict(time=1.0, reader="nvml", device="cuda:0", total_bytes=100,
                                     used_bytes=40, free_bytes=60)
    fields.update(changes)
    return MemorySample(**fields)  # type: ignore[arg-type]


def test_to_dict_is_plain_json() -> None:
    s = _sample(process_bytes=7, utilization=12.5, activation_bytes=3)
    d = s.to_dict()
    assert d["reader"] == "nvml" and type(d["reader"]) is str
    assert s.reader is ReaderKind.NVML and s.reader == "nvml"
    assert set(d) == {f.name for f in dataclasses.fields(MemorySample)}
    picked = (d["process_bytes"], d["utilization"], d["activation_bytes"], d["peak_bytes"])
    assert picked == (7, 12.5, 3, None)


def test_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        _sample().used_bytes = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"reader": "gpu"}, "reader"),
        ({"total_bytes": -1}, "total_bytes"),
        ({"used_bytes": 1.5}, "used_bytes"),
        ({"free_bytes": True}, "free_bytes"),
        ({"process_bytes": -3}, "process_bytes"),
        ({"utilization": 101.0}, "utilization"),
        ({"time": float("nan")}, "time"),
    ],
)
def test_validation_names_the_field(changes: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        _sample(**changes)
