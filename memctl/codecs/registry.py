"""Codec registry: ``get(name)``, ``names()`` and ``decode(packed)``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from memctl.codecs.base import Codec, Impl, Packed
from memctl.errors import CodecError

__all__ = ["decode", "get", "names"]


def _quantize(**config: Any) -> Codec:
    from memctl.codecs.quantize.codec import QuantizeCodec

    return QuantizeCodec(**config)


def _errorbound(**config: Any) -> Codec:
    from memctl.codecs.errorbound.codec import ErrorBoundCodec

    return ErrorBoundCodec(**config)


def _lossless(**config: Any) -> Codec:
    from memctl.codecs.lossless.codec import LosslessCodec

    return LosslessCodec(**config)


# An immutable table of factories: importing a codec module (and Numba) waits for first use.
_FACTORIES: dict[str, Callable[..., Codec]] = {
    "quantize": _quantize,
    "errorbound": _errorbound,
    "lossless": _lossless,
}


def names() -> list[str]:
    """Names of the registered codecs."""
    return sorted(_FACTORIES)


def get(name: str, **config: Any) -> Codec:
    """A codec by name, configured with ``config`` (e.g. ``get("quantize", group_size=128)``)."""
    factory = _FACTORIES.get(name)
    if factory is None:
        raise CodecError(f"unknown codec {name!r}; registered codecs are {names()}")
    return factory(**config)


def decode(p: Packed, *, impl: Impl | str | None = None) -> torch.Tensor:
    """Decode any record with the codec that wrote it (its configuration travels in ``p.params``)."""
    return get(p.codec).decode(p, impl=impl)
