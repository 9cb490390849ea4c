"""The ``quantize`` codec (ActNN stochastic quantization).

Record format and codec in ``codec``, PyTorch reference in ``_reference``, Numba CPU
kernels and launchers in ``_kernels``, CUDA kernels in ``_cuda``.
"""

from memctl.codecs.quantize.codec import BITS, QuantizeCodec, QuantizeConfig, packed_nbytes

__all__ = ["BITS", "QuantizeCodec", "QuantizeConfig", "packed_nbytes"]
