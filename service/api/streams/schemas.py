"""The metrics API's models: one point per reported step, and the page of them."""

from __future__ import annotations

from pydantic import BaseModel, Field

__all__ = ["METRIC_FIELDS", "MetricPoint", "MetricsOut"]


class MetricPoint(BaseModel):
    step: int
    attempt: int
    ts: float
    steps: int | None = None
    time: float | None = None
    loss: float | None = None
    val_loss: float | None = None
    lr: float | None = None
    grad_norm: float | None = None
    tokens_per_s: float | None = None
    tokens_per_s_per_device: float | None = None
    step_time_s: float | None = None
    tflops: float | None = None
    mfu: float | None = None
    mem_peak_bytes: float | None = None
    data_wait_frac: float | None = None
    # family moe (trainer/moe.py): the router's losses and how the tokens spread over experts
    aux_loss: float | None = None
    router_z_loss: float | None = None
    expert_load_max: float | None = None
    expert_load_cv: float | None = None


METRIC_FIELDS: tuple[str, ...] = tuple(
    name for name in MetricPoint.model_fields if name not in ("step", "attempt", "ts")
)


class MetricsOut(BaseModel):
    job_id: str
    total: int = Field(description="points after since_step, before downsampling")
    downsampled: bool
    points: list[MetricPoint]
