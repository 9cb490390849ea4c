"""The codec registry: names, configured instances, unknown names, decode dispatch."""

from __future__ import annotations

import pytest
import torch

from memctl import codecs
from memctl.codecs import Codec, Packed
from memctl.codecs.lossless.codec import LosslessCodec
from memctl.codecs.quantize.codec import QuantizeCodec
from memctl.errors import CodecError, ConfigError


def test_names_lists_the_codecs() -> None:
    assert codecs.names() == sorted(codecs.names())
    assert {"quantize", "lossless", "errorbound"} <= set(codecs.names())


def test_get_returns_configured_codecs() -> None:
    q = codecs.get("quantize", group_size=128)
    assert isinstance(q, QuantizeCodec) and isinstance(q, Codec)
    assert q.name == "quantize" and q.config.group_size == 128
    assert codecs.get("quantize").config.group_size == 256
    lossless = codecs.get("lossless")
    assert isinstance(lossless, LosslessCodec) and isinstance(lossless, Codec)
    assert codecs.get("quantize") is not codecs.get("quantize")  # no shared instances


def test_get_rejects_unknown_names_and_bad_config() -> None:
    with pytest.raises(CodecError, match=r"'zstd'.*lossless"):
        codecs.get("zstd")
    with pytest.raises(ConfigError, match="group_size=100"):
        codecs.get("quantize", group_size=100)
    with pytest.raises(ConfigError, match="no option"):
        codecs.get("lossless", group_size=8)


def test_decode_dispatches_on_the_record() -> None:
    x = torch.randn(3, 50)
    q = codecs.get("quantize", group_size=64).encode(x, bits=8)
    y = codecs.decode(q)
    assert isinstance(q, Packed) and q.codec == "quantize"
    assert y.shape == x.shape and (y - x).abs().max() < (x.max() - x.min()) / 255 + 1e-6
    mask = x > 0
    m = codecs.get("lossless").encode(mask)
    assert m.codec == "lossless" and torch.equal(codecs.decode(m), mask)
    assert torch.equal(codecs.decode(m, impl="reference"), mask)
