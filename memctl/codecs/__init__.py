"""Activation codecs: tensors to packed records and back.

>>> from memctl import codecs
>>> p = codecs.get("quantize").encode(x, bits=2)   # doctest: +SKIP
>>> y = codecs.decode(p)                           # doctest: +SKIP

See NOTE [ Codec contract ] in :mod:`memctl.codecs.base`.
"""

from memctl.codecs.base import FLOAT_DTYPES, Codec, Impl, Packed
from memctl.codecs.registry import decode, get, names

__all__ = ["FLOAT_DTYPES", "Codec", "Impl", "Packed", "decode", "get", "names"]
