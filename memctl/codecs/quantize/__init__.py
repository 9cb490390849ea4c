"""The ``quantize`` codec (ActNN stochastic quantization).

Record format and codec in ``codec``, PyTorch reference in ``_reference``, Numba CPU
kernels and launchers in ``_kernels``, CUDA kernels in ``_cuda``, the exception lists that wait
for a GPU's flag in ``_pending``.
"""

from memctl.codecs.quantize._pending import poll as poll_checks
from memctl.codecs.quantize._pending import settle as settle_checks
from memctl.codecs.quantize.codec import BITS, QuantizeCodec, QuantizeConfig, packed_nbytes

__all__ = ["BITS", "QuantizeCodec", "QuantizeConfig", "packed_nbytes", "poll_checks", "settle_checks"]
