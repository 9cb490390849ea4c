"""Every codec refuses what it cannot encode or decode with a memctl error that says why:
sparse, nested, quantized and meta tensors, absurd bounds, unknown options, non-records."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from memctl import codecs
from memctl.errors import CodecError, ConfigError

_ARGS: dict[str, dict[str, Any]] = {
    "quantize": {"bits": 2}, "errorbound": {"error_bound": 1e-3}, "lossless": {},
}
NAMES = sorted(_ARGS)


def _x() -> torch.Tensor:
    return torch.randn(16, 32, generator=torch.Generator().manual_seed(0))


_UNENCODABLE: dict[str, tuple[Callable[[], torch.Tensor], str]] = {
    "sparse_coo": (lambda: _x().to_sparse(), "layout=torch.sparse_coo"),
    "sparse_csr": (lambda: _x().to_sparse_csr(), "layout=torch.sparse_csr"),
    "nested": (lambda: torch.nested.nested_tensor([torch.randn(3, 4), torch.randn(5, 4)]), "nested"),
    "meta_float": (lambda: torch.empty(16, 32, device="meta"), "'meta' device"),
    "meta_bool": (lambda: torch.empty(64, dtype=torch.bool, device="meta"), "'meta' device"),
    "quantized": (lambda: torch.quantize_per_tensor(_x(), 0.1, 0, torch.qint8), "quantized"),
}


@pytest.mark.filterwarnings("ignore:.*(quantized tensor creation|Sparse CSR|nested tensors).*:UserWarning")
@pytest.mark.parametrize("kind", sorted(_UNENCODABLE))
@pytest.mark.parametrize("name", NAMES)
def test_tensors_without_dense_values_are_a_codec_error(name: str, kind: str) -> None:
    make, needle = _UNENCODABLE[kind]
    t = make()
    with pytest.raises(CodecError, match=needle.replace("(", r"\(").replace(")", r"\)")) as info:
        codecs.get(name).encode(t, **_ARGS[name])
    assert name in str(info.value)


@pytest.mark.parametrize("bound", [10**400, -(10**400), float("inf"), float("nan"), 0, -1e-3])
def test_absurd_error_bounds_are_a_config_error(bound: object) -> None:
    with pytest.raises(ConfigError, match=r"error_bound=.*must be finite and > 0"):
        codecs.get("errorbound").encode(_x(), error_bound=bound)  # type: ignore[arg-type]


@pytest.mark.parametrize(("name", "options", "needle"), [
    ("quantize", {"foo": 1}, "has no option(s) ['foo']; its options are: group_size, bits"),
    ("errorbound", {"bits": 2}, "has no option(s) ['bits']; its options are: group_size"),
    ("lossless", {"group_size": 8}, "has no option(s) ['group_size']; its options are: none"),
    ("quantize", {"group_size": 10**400}, "group_size=an int of"),
    ("errorbound", {"group_size": 2**40}, "up to 16777216"),
])
def test_unknown_or_absurd_options_are_a_config_error(name: str, options: dict[str, Any],
                                                      needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        codecs.get(name, **options)
    assert needle in str(info.value)


@pytest.mark.parametrize("record", ["x", None, 3, b"bytes", torch.zeros(3)])
def test_decoding_what_is_not_a_record_is_a_codec_error(record: object) -> None:
    with pytest.raises(CodecError, match="Packed record"):
        codecs.decode(record)  # type: ignore[arg-type]
    for name in NAMES:
        with pytest.raises(CodecError, match="Packed record"):
            codecs.get(name).decode(record)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", [None, 3, "Quantize"])
def test_unknown_codec_names_are_a_codec_error(name: object) -> None:
    with pytest.raises(CodecError, match="registered codecs are"):
        codecs.get(name)  # type: ignore[arg-type]
