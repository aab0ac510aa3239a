"""A sweep's request and answer models: the search space by dotted path over the job spec."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from service.api.core.schemas import Text, UTCDatetime
from service.api.jobs.schemas import JobStatus

__all__ = [
    "Choice",
    "EarlyStop",
    "Param",
    "SweepIn",
    "SweepList",
    "SweepOut",
    "TrialOut",
]

SweepStatus = Literal["running", "finished", "cancelled"]

# A path over the job spec's fields, "train.optim.lr"; checked against JobSpec on submit.
Path = Annotated[
    str,
    StringConstraints(
        min_length=1, max_length=200, pattern=r"^[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)*$"
    ),
]
Value = bool | int | float | str


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Choice(_In):
    type: Literal["choice"]
    values: list[Value] = Field(min_length=1, max_length=100)


class Uniform(_In):
    type: Literal["uniform", "loguniform"]
    low: float
    high: float


class IntRange(_In):
    type: Literal["int"]
    low: int = Field(ge=-(2**31), le=2**31 - 1)
    high: int = Field(ge=-(2**31), le=2**31 - 1)
    step: int = Field(1, ge=1, le=2**31 - 1)
    log: bool = False


Param = Annotated[Choice | Uniform | IntRange, Field(discriminator="type")]


class EarlyStop(_In):
    """Optuna's pruners, fed the sweep's metric as the trials report it: ``asha``
    (SuccessiveHalvingPruner: rungs at min_steps * reduction_factor^k, a trial goes on only
    if it is in the top 1/reduction_factor at its rung) or ``median`` (MedianPruner: stopped
    when worse than the median of the trials before it at the same step)."""

    method: Literal["asha", "median"]
    min_steps: int = Field(1, ge=1, le=10_000_000)
    reduction_factor: int = Field(2, ge=2, le=100)
    startup_trials: int = Field(1, ge=0, le=1000, description="median: trials done first")


class SweepIn(_In):
    """``POST /v1/sweeps``."""

    name: Text = Field("sweep", min_length=1, max_length=200)
    base: dict[str, Any] = Field(description="the job spec every trial starts from")
    space: dict[Path, Param] = Field(min_length=1, max_length=32)
    method: Literal["grid", "random", "tpe"] = "random"
    metric: str = Field("val_loss", max_length=32)
    goal: Literal["min", "max"] = "min"
    budget: int = Field(10, ge=1, le=1000, description="trials at most (grid: its size)")
    parallelism: int = Field(2, ge=1, le=256, description="trials queued or running at once")
    seed: int | None = Field(None, ge=0, le=2**32 - 1)
    early_stop: EarlyStop | None = None


class TrialOut(BaseModel):
    number: int
    job_id: str
    status: JobStatus
    params: dict[str, Any]
    value: float | None = Field(None, description="the metric's last value (what Optuna is told)")
    best: float | None = Field(None, description="the metric's best value so far")
    step: int | None = None


class SweepOut(BaseModel):
    id: str
    name: str
    owner: str
    status: SweepStatus
    message: str | None = None
    method: str
    metric: str
    goal: str
    budget: int
    parallelism: int
    seed: int | None = None
    space: dict[str, Any]
    early_stop: dict[str, Any] | None = None
    proposed: int
    created_at: UTCDatetime
    ended_at: UTCDatetime | None = None
    best_trial: TrialOut | None = None
    trials: list[TrialOut] = Field(default_factory=list)


class SweepList(BaseModel):
    items: list[SweepOut]
