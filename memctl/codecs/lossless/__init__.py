"""The ``lossless`` codec (bool bit-packing, integer narrowing): codec in ``codec``, PyTorch
reference in ``_reference``, Numba CPU kernels and launchers in ``_kernels``, CUDA kernels in ``_cuda``.
"""

from memctl.codecs.lossless.codec import LosslessCodec, LosslessConfig

__all__ = ["LosslessCodec", "LosslessConfig"]
