"""The controller: saved-tensor hooks, statistics, bit allocation, budget and batch size."""

from memctl.controller.budget import BudgetSpec, format_bytes, parse_budget, resolve_budget
from memctl.controller.config import KEEP_BITS, CodecMode, ControllerConfig, Objective
from memctl.controller.controller import Controller
from memctl.controller.oom import guarded_step
from memctl.controller.sampler import AdaptiveBatchSampler

__all__ = [
    "KEEP_BITS",
    "AdaptiveBatchSampler",
    "BudgetSpec",
    "CodecMode",
    "Controller",
    "ControllerConfig",
    "Objective",
    "format_bytes",
    "guarded_step",
    "parse_budget",
    "resolve_budget",
]
