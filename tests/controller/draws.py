"""Statistics over draws of the codec's rounding, for tests of unbiased gradients."""

from __future__ import annotations

import math

import torch


def bias_over_noise(exact: torch.Tensor, rows: torch.Tensor) -> float:
    """Mean over values of the squared bias of ``rows`` (one draw each) over its standard error:
    about 1 for unbiased draws. Values no draw changes (read from exact records) are left out
    when their mean is within 0.1% of the largest exact value (float rounding), and make it
    infinite otherwise."""
    se = rows.std(0) / rows.shape[0] ** 0.5
    mean = rows.mean(0)
    varies = se > 0
    if not bool(varies.all()):
        tolerance = 1e-3 * float(exact.abs().max())
        if float((mean - exact)[~varies].abs().max()) > tolerance:
            return math.inf
    return float(((mean - exact)[varies] / se[varies]).square().mean())
