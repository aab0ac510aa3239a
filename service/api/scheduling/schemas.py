"""The workers and queues views (``GET /v1/workers``, ``GET /v1/queues``)."""

from __future__ import annotations

from pydantic import BaseModel, Field

__all__ = ["QueueList", "QueueOut", "QueuedGroup", "RunningGroup", "WorkerList", "WorkerOut"]


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
    owner: str | None = Field(
        description="null: other owners' jobs, counted together (an admin sees names)"
    )
    priority: int
    jobs: int


class RunningGroup(BaseModel):
    owner: str | None = Field(
        description="null: other owners' jobs, counted together (an admin sees names)"
    )
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
