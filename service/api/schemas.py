"""The API's request and response models (the OpenAPI schema is generated from these).

A job spec's ``train`` field is exactly ``trainer.config.TrainConfig``: one definition of a
training spec for the service that validates it and the trainer that runs it. Every model
that takes input forbids unknown fields and bounds every number.
"""

from __future__ import annotations

import hashlib
import json
import re
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints

from trainer.config import TrainConfig, reject_nul
from worker.message import QUEUE_PATTERN

__all__ = [
    "AttemptOut",
    "JobList",
    "JobOut",
    "JobSpec",
    "JobStatus",
    "JobSummary",
    "LatestMetrics",
    "MetricPoint",
    "MetricsOut",
    "QueueList",
    "QueueOut",
    "WorkerList",
    "WorkerOut",
]

JobStatus = Literal["queued", "running", "cancelling", "succeeded", "failed", "cancelled"]
AttemptStatus = Literal["dispatched", "running", "exited", "lost"]


def _utc(value: datetime) -> datetime:
    # SQLite returns naive datetimes; everything the service stores is UTC.
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


UTCDatetime = Annotated[datetime, AfterValidator(_utc)]
LabelKey = Annotated[
    str, StringConstraints(min_length=1, max_length=63, pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]*$")
]

# C0 and C1 controls, DEL, line/paragraph separators and bidi overrides: a name or label
# with one can rewrite a terminal row or forge a line in `trainq ls`.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def reject_control(value: str) -> str:
    reject_nul(value)
    found = _CONTROL.search(value)
    if found:
        raise ValueError(
            f"must not contain control characters (U+{ord(found.group()):04X} at {found.start()})"
        )
    return value


Text = Annotated[str, AfterValidator(reject_control)]
LabelValue = Annotated[Text, StringConstraints(max_length=255)]


class JobSpec(BaseModel):
    """What a client submits (JSON or YAML)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    name: Text = Field("job", min_length=1, max_length=200)
    labels: dict[LabelKey, LabelValue] = Field(default_factory=dict, max_length=64)
    queue: str = Field("default", pattern=QUEUE_PATTERN)
    nodes: int = Field(1, ge=1, le=1024)
    procs_per_node: int = Field(1, ge=1, le=64)
    max_runtime_s: int | None = Field(None, ge=1, le=30 * 86400)
    retries: int = Field(0, ge=0, le=20)
    # Admission order (service.api.admit): higher first; above the owner's max_priority
    # (``trainq token limits``, else TRAINQ_MAX_PRIORITY) a submit is refused with 403.
    priority: int = Field(0, ge=-1000, le=1000)
    train: TrainConfig

    def spec_hash(self) -> str:
        """Same spec, same hash, whatever the key order or defaults left out."""
        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()


class LatestMetrics(BaseModel):
    step: int
    steps: int | None = None
    loss: float | None = None
    val_loss: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None


class AttemptOut(BaseModel):
    number: int
    status: AttemptStatus
    host: str | None = None
    worker: str | None = None
    exit_code: int | None = None
    reason: str | None = None
    message: str | None = None
    created_at: UTCDatetime
    started_at: UTCDatetime | None = None
    ended_at: UTCDatetime | None = None


class JobSummary(BaseModel):
    id: str
    name: str
    owner: str
    queue: str
    labels: dict[str, str]
    status: JobStatus
    reason: str | None = None
    message: str | None = None
    attempt: int
    retries: int
    retries_used: int
    priority: int = 0
    created_at: UTCDatetime
    started_at: UTCDatetime | None = None
    ended_at: UTCDatetime | None = None
    latest: LatestMetrics | None = None


class JobOut(JobSummary):
    nodes: int
    procs_per_node: int
    max_runtime_s: int | None = None
    train: dict[str, Any] = Field(description="the TrainConfig as stored, defaults filled in")
    pending_reason: str | None = Field(
        None, description='for a queued job: "no worker serves queue X" or "position N in queue X"'
    )
    attempts: list[AttemptOut] = Field(default_factory=list)


class JobList(BaseModel):
    items: list[JobSummary]
    next_cursor: str | None = None


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


METRIC_FIELDS: tuple[str, ...] = tuple(
    name for name in MetricPoint.model_fields if name not in ("step", "attempt", "ts")
)


class MetricsOut(BaseModel):
    job_id: str
    total: int = Field(description="points after since_step, before downsampling")
    downsampled: bool
    points: list[MetricPoint]


class WorkerOut(BaseModel):
    name: str
    host: str | None = None
    queues: list[str] = Field(default_factory=list)
    slots: int | None = None
    gpus: list[int] = Field(default_factory=list)
    running: list[str] = Field(default_factory=list)  # the caller's jobs (admin: all)
    busy: int = 0  # attempts running, whoever owns them
    ts: float
    age_s: float


class WorkerList(BaseModel):
    items: list[WorkerOut]


class QueuedGroup(BaseModel):
    owner: str
    priority: int
    jobs: int


class RunningGroup(BaseModel):
    owner: str
    jobs: int
    units: int = Field(description="slots held (GPUs on a GPU queue)")


class QueueOut(BaseModel):
    name: str
    workers: int = Field(description="live workers serving it (draining ones excluded)")
    slots: int
    free_slots: int
    largest_slot_procs: int = Field(description="the most ranks per node one slot holds")
    gpus: int
    queued: int
    running: int
    queued_by: list[QueuedGroup] = Field(description="queued jobs by owner and priority")
    running_by: list[RunningGroup]


class QueueList(BaseModel):
    items: list[QueueOut]


class PlanParameters(BaseModel):
    total: int | None = Field(None, description="every parameter (LoRA's adapters included)")
    trainable: int | None = Field(None, description="with LoRA, only the adapters")


class PlanDeviceMemory(BaseModel):
    """Bytes per device (one rank); the formulas are trainer/plan.py's."""

    weights: int
    gathered: int = Field(description="FSDP's unsharded parameters (0 under ddp)")
    gradients: int
    optimizer: int = Field(description="AdamW's two fp32 moments of the trainable parameters")
    activations: int = Field(description="one micro-batch's, for the activation checkpointing")
    optimizer_step: int = Field(description="the step's temporaries (never with activations)")
    total: int = Field(
        description="what is always there plus the larger of backward's peak and the step's"
    )


class PlanHostMemory(BaseModel):
    """Bytes per rank that fsdp.cpu_offload moves to host memory (0 without it)."""

    weights: int
    gradients: int
    optimizer: int
    total: int


class PlanMemory(BaseModel):
    device: PlanDeviceMemory
    host: PlanHostMemory
    host_per_node: int


class PlanOut(BaseModel):
    """``POST /v1/jobs?dry_run=true``: what the spec would need, before anything runs."""

    family: str
    world_size: int = Field(description="nodes * procs_per_node")
    tokens_per_step: int
    parameters: PlanParameters
    memory: PlanMemory | None = Field(None, description="null when the model is unknown")
    fits: bool | None = Field(
        None, description="the device estimate against the queue's smallest device; null: unknown"
    )
    fits_reason: str
    device_memory_bytes: int | None = None
    notes: list[str] = Field(default_factory=list)
