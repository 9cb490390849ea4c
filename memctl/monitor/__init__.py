"""Memory readers (NVML, PyTorch's allocator, host) and a sampler with a bounded history.

Nothing here touches CUDA or NVML at import time: readers import ``torch`` and
``pynvml`` when they are built.
"""

from __future__ import annotations

from memctl.monitor.nvml import NvmlReader, nvml_index
from memctl.monitor.readers import HostReader, MemoryReader, TorchAllocatorReader, cuda_index
from memctl.monitor.sample import ActivationBytesFn, MemorySample, ReaderKind
from memctl.monitor.sampler import Sampler, SamplerConfig
from memctl.monitor.selection import fallback_reader, reader_chain, select_reader

__all__ = [
    "ActivationBytesFn",
    "HostReader",
    "MemoryReader",
    "MemorySample",
    "NvmlReader",
    "ReaderKind",
    "Sampler",
    "SamplerConfig",
    "TorchAllocatorReader",
    "cuda_index",
    "fallback_reader",
    "nvml_index",
    "reader_chain",
    "select_reader",
]
