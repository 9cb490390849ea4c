"""Cumulative timing histograms of the controller's own work: :class:`Timings`.

NOTE [ What is timed, and what it costs ]
Three histograms, kept for the life of a controller and exported by ``/metrics``:

- ``encode``: seconds per compressed tensor in the pack hook (the codec's encode, plus the
  ReLU mask when there is one);
- ``decode``: seconds per compressed tensor in the unpack hook (decode, mask re-applied);
  small records encoded and decoded in batches (NOTE [ Batched small records ] in
  batches.py) count one observation per batch in each histogram, not one per record;
- ``step``: seconds of memctl work per training step: the step boundary (statistics,
  allocation, batch size, publishing) plus that step's encode and decode time.

Each observation is two ``time.perf_counter()`` calls and a bisection into fixed buckets
(about 2.5 µs measured on a loaded 2-core CPU machine, call overhead included), small
beside any encode. On a GPU the codecs launch kernels
asynchronously, so encode/decode time is the host's time to launch them, not the kernels'
run time; nothing here synchronises the device. Encode runs in the forward (the training
thread) and decode in the backward (autograd's thread for that device), each writing only
its own histogram; readers get copies published at the step boundary.
"""

from __future__ import annotations

import bisect
from typing import Any

__all__ = ["BUCKETS", "Histogram", "Timings"]

#: Upper bounds (seconds) of the histogram buckets; a last ``+Inf`` bucket catches the rest.
BUCKETS: tuple[float, ...] = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0,
)


class Histogram:
    """Counts per bucket, the sum and the count of observed durations (seconds)."""

    __slots__ = ("count", "counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        self.sum += seconds
        self.count += 1

    def to_dict(self) -> dict[str, Any]:
        """``buckets``: [upper bound, cumulative count] pairs ending with ``inf``; ``sum``; ``count``."""
        cumulative = []
        running = 0
        for bound, n in zip((*BUCKETS, float("inf")), self.counts, strict=True):
            running += n
            cumulative.append([bound, running])
        return {"buckets": cumulative, "sum": self.sum, "count": self.count}


class Timings:
    """The controller's three histograms (see NOTE [ What is timed, and what it costs ])."""

    __slots__ = ("_step_codec_s", "decode", "encode", "step")

    def __init__(self) -> None:
        self.encode = Histogram()
        self.decode = Histogram()
        self.step = Histogram()
        self._step_codec_s = 0.0

    def observe_encode(self, seconds: float) -> None:
        # Histogram.observe written out: once a record, on the pack and unpack paths
        h = self.encode
        h.counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        h.sum += seconds
        h.count += 1
        self._step_codec_s += seconds

    def observe_decode(self, seconds: float) -> None:
        h = self.decode
        h.counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        h.sum += seconds
        h.count += 1
        self._step_codec_s += seconds

    def observe_step(self, boundary_s: float) -> None:
        """Close a step: its boundary time plus the encode/decode time since the last one."""
        self.step.observe(boundary_s + self._step_codec_s)
        self._step_codec_s = 0.0

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {"encode": self.encode.to_dict(), "decode": self.decode.to_dict(), "step": self.step.to_dict()}
