"""The API's request and response models (the OpenAPI schema is generated from these).

A job spec's ``train`` field is exactly ``trainer.config.TrainConfig``: one definition of a
training spec for the service that validates it and the trainer that runs it. Every model
that takes input forbids unknown fields and bounds every number.
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from service.api.core.schemas import Text, UTCDatetime
from trainer.config import TrainConfig
from worker.message import QUEUE_PATTERN

__all__ = [
    "AttemptOut",
    "JobList",
    "JobOut",
    "JobSpec",
    "JobStatus",
    "JobSummary",
    "LatestMetrics",
    "PlanOut",
]

JobStatus = Literal[
    "queued", "running", "cancelling", "succeeded", "failed", "cancelled", "stopped_early"
]
AttemptStatus = Literal["dispatched", "running", "exited", "lost"]


LabelKey = Annotated[
    str, StringConstraints(min_length=1, max_length=63, pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]*$")
]

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
    # Admission order (service.api.scheduling.admit): higher first; above the owner's max_priority
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
    sweep: str | None = Field(None, description="the sweep this job is a trial of")
    params: dict[str, Any] | None = Field(None, description="a trial's values, by dotted path")


class JobList(BaseModel):
    items: list[JobSummary]
    next_cursor: str | None = None


class PlanParameters(BaseModel):
    total: int | None = Field(None, description="every parameter (LoRA's adapters included)")
    trainable: int | None = Field(None, description="with LoRA, only the adapters")
    active: int | None = Field(
        None, description="what one token computes with: total but the experts it is not routed to"
    )


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


class PlanDisk(BaseModel):
    """Bytes of the run folder (upper estimates; trainer/plan.py's ``disk``)."""

    checkpoint_bytes: int
    hf_bytes: int
    run_bytes: int = Field(
        description="at worst: checkpoint.keep checkpoints (with their HF folders when"
        " checkpoint.hf is every) while the next is written; refused above"
        " TRAINQ_RUNS_MAX_JOB_BYTES"
    )


class PlanLayout(BaseModel):
    """How the ranks hold the model (trainer/mesh.py): ddp replicates it on every rank, fsdp
    shards it over all of them, hsdp over ``shard`` ranks, ``replicate`` times over."""

    strategy: Literal["ddp", "fsdp", "hsdp"]
    replicate: int
    shard: int
    describe: str


class PlanOut(BaseModel):
    """``POST /v1/jobs?dry_run=true``: what the spec would need, before anything runs."""

    family: str
    world_size: int = Field(description="nodes * procs_per_node")
    layout: PlanLayout | None = None
    tokens_per_step: int
    parameters: PlanParameters
    memory: PlanMemory | None = Field(None, description="null when the model is unknown")
    disk: PlanDisk | None = Field(None, description="null when the model is unknown")
    fits: bool | None = Field(
        None, description="the device estimate against the queue's smallest device; null: unknown"
    )
    fits_reason: str
    device_memory_bytes: int | None = None
    notes: list[str] = Field(default_factory=list)
