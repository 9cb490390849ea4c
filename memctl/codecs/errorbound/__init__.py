"""The ``errorbound`` codec (SZ-style absolute error bound): codec in ``codec``, record format
constants in ``_format``, PyTorch reference in ``_reference``, the per-group steps shared by both
kernel targets in ``_ops``, Numba CPU kernels and launchers in ``_kernels``, CUDA kernels in ``_cuda``.
"""

from memctl.codecs.errorbound.codec import ErrorBoundCodec, bits_for_range

__all__ = ["ErrorBoundCodec", "bits_for_range"]
