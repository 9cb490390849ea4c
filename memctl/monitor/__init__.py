"""Memory readers (NVML, PyTorch's allocator, host) and a sampler with a bounded history."""
