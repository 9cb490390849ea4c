"""Statistics over draws of the codec's rounding, for tests of unbiased gradients."""

from __future__ import annotations

import torch


def bias_over_noise(exact: torch.Tensor, rows: torch.Tensor) -> float:
    """Mean over values of the squared bias of ``rows`` (one draw each) over its standard error:
    about 1 for unbiased draws."""
    se = rows.std(0) / rows.shape[0] ** 0.5
    return float(((rows.mean(0) - exact) / se).square().mean())
