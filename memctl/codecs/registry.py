"""Codec registry: ``get(name)``, ``names()`` and ``decode(packed)``."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from memctl.codecs.base import Codec, Impl, Packed
from memctl.errors import CodecError, ConfigError

__all__ = ["decode", "get", "names"]


def _quantize() -> type[Codec]:
    from memctl.codecs.quantize.codec import QuantizeCodec

    return QuantizeCodec


def _errorbound() -> type[Codec]:
    from memctl.codecs.errorbound.codec import ErrorBoundCodec

    return ErrorBoundCodec


def _lossless() -> type[Codec]:
    from memctl.codecs.lossless.codec import LosslessCodec

    return LosslessCodec


# An immutable table of the codec classes, each behind a function: importing a codec
# module (and Numba) waits for first use.
_FACTORIES: dict[str, Callable[[], type[Codec]]] = {
    "quantize": _quantize,
    "errorbound": _errorbound,
    "lossless": _lossless,
}


def names() -> list[str]:
    """Names of the registered codecs."""
    return sorted(_FACTORIES)


def get(name: str, **config: Any) -> Codec:
    """A codec by name, configured with ``config`` (e.g. ``get("quantize", group_size=128)``)."""
    factory = _FACTORIES.get(name) if isinstance(name, str) else None
    if factory is None:
        raise CodecError(f"unknown codec {name!r}; registered codecs are {names()}")
    cls = factory()
    options = [p.name for p in inspect.signature(cls).parameters.values()
               if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and not p.name.startswith("_")]
    unknown = sorted(set(config) - set(options))
    if unknown:
        allowed = ", ".join(options) if options else "none"
        raise ConfigError(f"codec {name!r} has no option(s) {unknown}; its options are: {allowed}")
    return cls(**config)


def decode(p: Packed, *, impl: Impl | str | None = None) -> torch.Tensor:
    """Decode any record with the codec that wrote it (its configuration travels in ``p.params``)."""
    if not isinstance(p, Packed):
        raise CodecError(
            f"codecs.decode takes a Packed record (what a codec's encode returns), got {type(p).__name__}"
        )
    return get(p.codec).decode(p, impl=impl)
