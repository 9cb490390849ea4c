"""The exceptions memctl raises.

Every message says what was expected, what came, and how to fix it.
"""

from __future__ import annotations


class MemctlError(Exception):
    """Base class of every error memctl raises on purpose."""


class ConfigError(MemctlError, ValueError):
    """A configuration value is invalid (names the field, the value and what is allowed)."""


class BudgetError(ConfigError):
    """A memory budget could not be parsed or cannot be applied."""


class CodecError(MemctlError, RuntimeError):
    """A codec could not encode or decode a tensor."""


class CudaUnavailableError(CodecError):
    """CUDA kernels were requested but cannot be compiled or run on this machine."""


class MissingExtraError(MemctlError, ImportError):
    """An optional feature needs packages from one of memctl's extras that are not installed."""
