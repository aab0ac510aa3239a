"""The frozen job message the service sends to a worker (Celery task argument).

Light on purpose: no celery, no torch. The service builds it after committing the job row;
the worker receives it as plain JSON and never talks to the database.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainer.config import TrainConfig

__all__ = ["TASK_NAME", "JobMessage"]

TASK_NAME = "trainq.run_attempt"


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
