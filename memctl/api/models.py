"""Pydantic models of the HTTP service's requests and responses (they make the OpenAPI schema)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

__all__ = [
    "AllocationModel",
    "BudgetChangeResponse",
    "BudgetInfoResponse",
    "BudgetRequest",
    "ErrorItem",
    "ErrorResponse",
    "EventModel",
    "HealthResponse",
    "HistoryResponse",
    "LayerModel",
    "LayersResponse",
    "MemoryModel",
    "RankRow",
    "RanksResponse",
    "StatsResponse",
]

# A budget as typed by a user: int bytes, "10GiB", "75%", or None for no limit.
Target = int | str | None


class _Model(BaseModel):
    # Non-finite floats (a ratio over zero bytes) become null rather than invalid JSON.
    model_config = ConfigDict(ser_json_inf_nan="null", frozen=True)


class MemoryModel(_Model):
    """One monitor sample (``memctl.monitor.MemorySample.to_dict()``)."""

    time: float
    reader: Literal["nvml", "torch", "host"]
    device: str
    total_bytes: int
    used_bytes: int
    free_bytes: int
    process_bytes: int | None = None
    utilization: float | None = None
    allocated_bytes: int | None = None
    reserved_bytes: int | None = None
    peak_bytes: int | None = None
    activation_bytes: int | None = None


class AllocationModel(_Model):
    """The last bit allocation."""

    solver: str
    status: str
    time_ms: float
    objective: float | None
    feasible: bool
    step: int


class EventModel(_Model):
    """One decision of the controller."""

    step: int
    time: float
    kind: str
    message: str


class LayerModel(_Model):
    """One compressed layer."""

    name: str
    bits: float | None
    error_bound: float | None
    raw_bytes: int
    packed_bytes: int
    sensitivity: float


class HealthResponse(_Model):
    status: Literal["ok"] = "ok"
    step: int


class StatsResponse(_Model):
    """The controller's state at the last step boundary."""

    step: int
    budget: Target
    budget_bytes: int | None
    activation_budget_bytes: int | None
    static_bytes: int = Field(0, description="parameters, gradients, buffers, optimizer state "
                              "(and GPU allocator workspace): what the budget counts besides activations")
    memory: MemoryModel | None
    raw_bytes: int
    packed_bytes: int
    other_bytes: int = Field(0, description="saved activations kept exact (not compressed)")
    ratio: float
    avg_bits: float
    batch_size: int | None
    allocation: AllocationModel | None
    fallbacks: int
    events: list[EventModel]
    rank: int | None = None
    world_size: int = 1
    agreed: bool = True  # every rank applies the same allocation and batch size


class RankRow(_Model):
    """One rank's figures in the aggregated view (NOTE [ Aggregated view ])."""

    rank: int
    step: int = Field(description="the step at which this row was taken (the last allocation step)")
    raw_bytes: int
    packed_bytes: int
    other_bytes: int = 0
    ratio: float
    avg_bits: float
    batch_size: int | None
    budget_bytes: int | None
    activation_budget_bytes: int | None
    static_bytes: int = 0
    process_bytes: int | None = Field(None, description="the rank's own device usage, latest sample")
    device_used_bytes: int | None = Field(None, description="its device's usage by every process")
    agreed: bool = True
    fallbacks: int = 0
    errors: int = 0


class RanksResponse(_Model):
    """Every rank of the job, as the serving rank last gathered them."""

    step: int = Field(description="the serving rank's current step")
    rank: int | None
    world_size: int
    agreed: bool
    ranks: list[RankRow]


class LayersResponse(_Model):
    step: int
    layers: list[LayerModel]


class BudgetInfoResponse(_Model):
    target: Target
    target_bytes: int | None
    activation_budget_bytes: int | None
    pending: Target
    device_total_bytes: int | None


class BudgetChangeResponse(_Model):
    """What will be applied, and when."""

    target: Target
    target_bytes: int | None
    applies_at_step: int
    status: Literal["pending"] = "pending"


_TARGET_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {"type": "integer", "minimum": 1, "description": "bytes"},
        {"type": "string", "description": "a size such as '10GiB', '800MB', or a percentage such as '75%'"},
        {"type": "null", "description": "no limit"},
    ],
    "examples": ["10GiB", 8589934592, "75%", None],
}


class BudgetRequest(BaseModel):
    """Body of ``PUT /v1/budget``. ``target`` is checked by ``parse_budget``, not by pydantic,
    so that a wrong type gets the same clear message as a wrong unit."""

    model_config = ConfigDict(extra="forbid")

    target: Annotated[Any, WithJsonSchema(_TARGET_SCHEMA)] = Field(
        description="the new device budget: int bytes, a size string, a percentage, or null for no limit"
    )


class HistoryResponse(_Model):
    count: int
    samples: list[MemoryModel]


class ErrorItem(_Model):
    loc: list[str | int]
    msg: str
    type: str


class ErrorResponse(_Model):
    """Every error: a human-readable ``detail``; validation errors also list ``errors``."""

    detail: str
    errors: list[ErrorItem] | None = None
