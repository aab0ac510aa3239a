"""The frozen job message the service sends to a worker (Celery task argument).

Light on purpose: no celery, no torch. The service builds it after committing the job row;
the worker receives it as plain JSON and never talks to the database.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainer.config import TrainConfig

__all__ = [
    "QUEUE_PATTERN",
    "TASK_NAME",
    "WORKER_NAME_PATTERN",
    "JobMessage",
    "broker_queue",
    "message_tag",
    "spec_queue",
    "worker_queue",
]

TASK_NAME = "trainq.run_attempt"

# What a queue name in a spec or on `trainq worker --queues` may be.
QUEUE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


def broker_queue(queue: str, prefix: str = "trainq") -> str:
    """The broker's name for trainq queue ``queue``: ``{prefix}.{queue}``.

    A user-chosen string never names a broker key by itself: kombu keeps its own bookkeeping
    in the broker database (``unacked``, ``unacked_index``, ``_kombu.binding.*``), and a
    queue named like one of those would be a list where kombu expects a hash or a sorted set,
    which kills every worker on the broker. Every trainq queue lives under the prefix, which
    none of kombu's or Celery's names start with.
    """
    return f"{prefix}.{queue}"


def message_tag(job_id: str, attempt: int, node_rank: int) -> str:
    """The ``argsrepr`` header of one node's message: readable in the broker, and unique to
    (job, attempt, node), so the service's reconciler can look for it in a queue."""
    return f"(job {job_id} attempt {attempt} node {node_rank})"


# A worker's name (``--hostname``, else the host's name): it names the worker's own queue.
WORKER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


def worker_queue(worker: str, prefix: str = "trainq") -> str:
    """The broker's name for worker ``worker``'s own queue, where the service's admitter
    sends the nodes it placed there: ``{prefix}.@{worker}``. ``@`` is in no queue name a spec
    may give (QUEUE_PATTERN), so no spec queue can ever name a worker's queue."""
    return f"{prefix}.@{worker}"


def spec_queue(name: str, prefix: str = "trainq") -> str:
    """``broker_queue``'s inverse (a name without the prefix is returned as it is)."""
    head = prefix + "."
    return name[len(head) :] if name.startswith(head) else name


class JobMessage(BaseModel):
    """One node's share of one attempt: a job of ``nodes`` nodes is sent as ``nodes`` messages
    that differ only in ``node_rank``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job_id: str = Field(min_length=1, max_length=64)
    attempt: int = Field(ge=1)
    queue: str = Field(min_length=1, max_length=64)
    nodes: int = Field(1, ge=1, le=1024)
    procs_per_node: int = Field(1, ge=1, le=64)
    node_rank: int = Field(0, ge=0)
    max_runtime_s: int | None = Field(None, ge=1)
    # Whose job it is: the worker checks a frozen ``data.dataset`` folder is this owner's
    # (trainer.paths). None in messages from before it was sent (the folder's shape only).
    owner: str | None = Field(None, min_length=1, max_length=128)
    train: TrainConfig

    @model_validator(mode="after")
    def _node_in_gang(self) -> JobMessage:
        if self.node_rank >= self.nodes:
            raise ValueError(f"node_rank {self.node_rank} is not below nodes={self.nodes}")
        return self

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @classmethod
    def from_json(cls, payload: dict[str, Any]) -> JobMessage:
        return cls.model_validate(payload)
