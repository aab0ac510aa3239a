"""The SQL store: jobs, their attempts, metrics (a row per reported step), logs, API tokens.

Alembic (``migrations/``) owns the schema; these models are what it is compared against.
Job ids are time-ordered hex, so ``ORDER BY id DESC`` is newest first and a keyset cursor is
just the last id seen. Times are UTC; SQLite hands them back naive, the schemas add the zone.
"""

from __future__ import annotations

import secrets
import time
from datetime import UTC, datetime
from typing import Any, cast

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

__all__ = [
    "ACTIVE_ATTEMPT",
    "ATTEMPTS",
    "DATASETS",
    "DATASET_OWNERS",
    "DATASET_STATUSES",
    "EVENTS",
    "EVENTS_PRUNED",
    "JOBS",
    "JOB_OWNERS",
    "LOGS",
    "METRICS",
    "OWNER_LIMITS",
    "SWEEPS",
    "TERMINAL",
    "WEBHOOKS",
    "WEBHOOK_DELIVERIES",
    "ApiToken",
    "Attempt",
    "Base",
    "Dataset",
    "DatasetOwner",
    "EventRecord",
    "EventsPruned",
    "Job",
    "JobOwner",
    "LogChunk",
    "Metric",
    "OwnerLimit",
    "Sweep",
    "Webhook",
    "WebhookDelivery",
    "new_job_id",
    "utcnow",
]

# Constraint names are part of the schema: with a convention, migrations can drop them by
# name on every backend instead of relying on what each database would invent.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

JOB_STATUSES = (
    "queued", "running", "cancelling", "succeeded", "failed", "cancelled", "stopped_early",
)  # fmt: skip
# stopped_early: a sweep's pruner stopped the trial (service.api.sweeps); its checkpoints stay.
TERMINAL = frozenset({"succeeded", "failed", "cancelled", "stopped_early"})
ATTEMPT_STATUSES = ("dispatched", "running", "exited", "lost")
ACTIVE_ATTEMPT = frozenset({"dispatched", "running"})

# BigInteger ids on PostgreSQL, but SQLite only autoincrements an INTEGER PRIMARY KEY.
BigId = BigInteger().with_variant(Integer(), "sqlite")


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_job_id() -> str:
    """12 hex digits of milliseconds, then 8 random: sorts by creation, unguessable enough."""
    return f"{int(time.time() * 1000):012x}{secrets.token_hex(4)}"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {datetime: DateTime(timezone=True), dict[str, Any]: JSON}


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    owner: Mapped[str] = mapped_column(String(128))
    name: Mapped[str] = mapped_column(String(200))
    queue: Mapped[str] = mapped_column(String(64))
    labels: Mapped[dict[str, Any]] = mapped_column(JSON)
    nodes: Mapped[int] = mapped_column(Integer)
    procs_per_node: Mapped[int] = mapped_column(Integer)
    max_runtime_s: Mapped[int | None] = mapped_column(Integer)
    retries: Mapped[int] = mapped_column(Integer)
    train: Mapped[dict[str, Any]] = mapped_column(JSON)  # TrainConfig, normalised
    spec_hash: Mapped[str] = mapped_column(String(64))  # what an idempotency key compares
    idempotency_key: Mapped[str | None] = mapped_column(String(200))

    status: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(String(32))
    message: Mapped[str | None] = mapped_column(Text)
    attempt: Mapped[int] = mapped_column(Integer)  # the current attempt's number
    retries_used: Mapped[int] = mapped_column(Integer, default=0)
    # Scheduling (service.api.scheduling.admit): higher first; held back until not_before (a gang's
    # backoff); preempted_at: when the admitter last asked it to yield its capacity.
    priority: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    not_before: Mapped[datetime | None]
    preempted_at: Mapped[datetime | None]

    created_at: Mapped[datetime]
    started_at: Mapped[datetime | None]
    ended_at: Mapped[datetime | None]

    # The latest metric point, kept on the row so GET /v1/jobs/{id} is one lookup.
    metric_attempt: Mapped[int | None] = mapped_column(Integer)
    last_step: Mapped[int | None] = mapped_column(Integer)
    last_metrics: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    # The run folder's worst case at submit (trainer.plan's disk estimate; 0: not known), what
    # the job counts against its owner's TRAINQ_RUNS_MAX_OWNER_BYTES while its row exists.
    disk_bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    # A sweep's trial (service.api.sweeps): its sweep, and the values it was given, by path.
    sweep: Mapped[str | None] = mapped_column(
        ForeignKey("sweeps.id", ondelete="SET NULL"), index=True
    )
    params: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))

    __table_args__ = (
        UniqueConstraint("owner", "idempotency_key"),
        Index("ix_jobs_owner_id", "owner", "id"),
        Index("ix_jobs_owner_status_id", "owner", "status", "id"),
        Index("ix_jobs_status_id", "status", "id"),
        Index("ix_jobs_queue_status_id", "queue", "status", "id"),
        Index("ix_jobs_name_id", "name", "id"),
    )


class Attempt(Base):
    __tablename__ = "attempts"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    number: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16))
    free: Mapped[bool] = mapped_column(Boolean, default=False)  # a preemption's retry
    host: Mapped[str | None] = mapped_column(String(255))
    worker: Mapped[str | None] = mapped_column(String(255))
    pid: Mapped[int | None] = mapped_column(Integer)
    exit_code: Mapped[int | None] = mapped_column(Integer)
    reason: Mapped[str | None] = mapped_column(String(32))
    message: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime]
    sent_at: Mapped[datetime | None]  # null: committed but not yet handed to Celery
    started_at: Mapped[datetime | None]
    ended_at: Mapped[datetime | None]
    hb_missing_since: Mapped[datetime | None]
    # Multi-node: the nodes that reported their exit so far, "n" -> {exit_code, reason}.
    node_exits: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    # The worker chosen for each node by the admitter (null: waiting for admission).
    placement: Mapped[list[str] | None] = mapped_column(JSON(none_as_null=True))

    __table_args__ = (
        UniqueConstraint("job_id", "number"),
        Index("ix_attempts_status_sent_at", "status", "sent_at"),
    )


class Metric(Base):
    __tablename__ = "metrics"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(Integer)
    ts: Mapped[float] = mapped_column(Float)
    data: Mapped[dict[str, Any]] = mapped_column(JSON)

    # A resumed attempt reports steps again; the unique key makes a replay a no-op.
    # The second serves the downsampled history, which reads in step order.
    __table_args__ = (
        UniqueConstraint("job_id", "attempt", "step"),
        Index("ix_metrics_job_id_step_attempt", "job_id", "step", "attempt"),
    )


class LogChunk(Base):
    __tablename__ = "logs"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    seq: Mapped[int] = mapped_column(BigInteger)  # the worker's event seq: replays collide
    ts: Mapped[float] = mapped_column(Float)
    lines: Mapped[list[dict[str, Any]]] = mapped_column(JSON)

    __table_args__ = (
        UniqueConstraint("job_id", "attempt", "seq"),
        Index("ix_logs_job_id_id", "job_id", "id"),
    )


class ApiToken(Base):
    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    # The owner of the jobs a token submits; tokens may share a name (rotation keeps jobs).
    name: Mapped[str] = mapped_column(String(128))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex
    admin: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime]
    revoked_at: Mapped[datetime | None]


class OwnerLimit(Base):
    """What an admin allows one owner (a token's name), set with ``trainq token limits``;
    a null column: the service's setting applies."""

    __tablename__ = "owner_limits"

    owner: Mapped[str] = mapped_column(String(128), primary_key=True)
    max_priority: Mapped[int | None] = mapped_column(Integer)
    max_running: Mapped[int | None] = mapped_column(Integer)  # slots (GPUs on GPU queues)
    max_queued: Mapped[int | None] = mapped_column(Integer)
    submits_per_minute: Mapped[int | None] = mapped_column(Integer)
    # The owner's default train.tracking (a TrackingConfig), for specs that name none.
    tracking: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    updated_at: Mapped[datetime]


DATASET_STATUSES = ("uploading", "preparing", "ready", "failed")


class Dataset(Base):
    """An uploaded corpus (service.api.datasets.service): its shards live in ``path``, relative to
    the data root; the counts are known once it is ``ready``."""

    __tablename__ = "datasets"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    owner: Mapped[str] = mapped_column(String(128))
    name: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(Text)
    format: Mapped[str] = mapped_column(String(16))  # text, jsonl, bin, chat or completion
    tokenizer: Mapped[str] = mapped_column(String(1024))  # "byte" or a path under the data root
    path: Mapped[str] = mapped_column(String(1024))
    bytes: Mapped[int] = mapped_column(BigInteger)  # uploaded so far, then the upload's size
    # What it counts against the owner's quota: reserved while in progress, then the
    # prepared folder's size (service.api.datasets.quota); a failed one counts nothing.
    disk_bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    documents: Mapped[int | None] = mapped_column(BigInteger)
    train_tokens: Mapped[int | None] = mapped_column(BigInteger)
    val_tokens: Mapped[int | None] = mapped_column(BigInteger)
    vocab_size: Mapped[int | None] = mapped_column(Integer)
    # chat and completion: what the preparation made (trainer.sft.SftReport)
    report: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]  # the uploading/preparing process's heartbeat
    ready_at: Mapped[datetime | None]

    __table_args__ = (
        UniqueConstraint("owner", "name"),
        Index("ix_datasets_status_updated_at", "status", "updated_at"),
    )


class DatasetOwner(Base):
    """One row per owner that has uploaded: every quota reservation locks (updates) it
    first, so reservations of one owner are serialized across API replicas."""

    __tablename__ = "dataset_owners"

    owner: Mapped[str] = mapped_column(String(128), primary_key=True)
    locked_at: Mapped[datetime]


class JobOwner(Base):
    """One row per owner that submitted under TRAINQ_RUNS_MAX_OWNER_BYTES: each such submit
    locks (updates) it first, so one owner's submits are checked one at a time across API
    replicas (service.api.jobs.room). Apart from ``dataset_owners``: an upload and a submit
    of one owner need not wait for each other."""

    __tablename__ = "job_owners"

    owner: Mapped[str] = mapped_column(String(128), primary_key=True)
    locked_at: Mapped[datetime]


class EventRecord(Base):
    """The outbox (service.api.events): what happened to an owner's jobs, checkpoints and
    sweeps, written in the transaction of the change itself. ``id`` is the feed's cursor and
    the order webhooks deliver in; ids commit in order (service.api.events.record)."""

    __tablename__ = "events"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    owner: Mapped[str] = mapped_column(String(128))
    type: Mapped[str] = mapped_column(String(64))  # job.running, checkpoint.written, ...
    job_id: Mapped[str | None] = mapped_column(String(32))  # no FK: it outlives the job
    data: Mapped[dict[str, Any]] = mapped_column(JSON)
    # What makes a replayed source record nothing twice (e.g. a checkpoint's job, attempt
    # and step); null: no such key (a state change is recorded once by its CAS anyway).
    dedupe_key: Mapped[str | None] = mapped_column(String(200), unique=True)
    created_at: Mapped[datetime]

    __table_args__ = (
        Index("ix_events_owner_id", "owner", "id"),
        Index("ix_events_created_at", "created_at"),  # retention walks the old ones
    )


class EventsPruned(Base):
    """How far retention pruned each owner's events: ``through_id``, the highest id of the
    owner's events it deleted (it only grows). A feed cursor below it has missed an event
    (``GET /v1/events`` answers 410); one at or above it has missed none, whatever was pruned
    of other owners' events. An owner none of whose events were pruned has no row."""

    __tablename__ = "events_pruned"

    owner: Mapped[str] = mapped_column(String(128), primary_key=True)
    through_id: Mapped[int] = mapped_column(BigInteger)
    pruned_at: Mapped[datetime]


class Webhook(Base):
    """An owner's webhook endpoint (service.api.webhooks); ``secret`` signs its deliveries
    (Standard Webhooks), shown once at creation. ``after_event``: the last event fanned out
    to it (it gets events from its creation on)."""

    __tablename__ = "webhooks"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    owner: Mapped[str] = mapped_column(String(128))
    url: Mapped[str] = mapped_column(String(2048))
    events: Mapped[list[str]] = mapped_column(JSON)  # patterns: job.*, checkpoint.written
    description: Mapped[str | None] = mapped_column(String(500))
    secret: Mapped[str] = mapped_column(String(128))
    enabled: Mapped[bool] = mapped_column(Boolean, default=True)
    disabled_reason: Mapped[str | None] = mapped_column(Text)
    after_event: Mapped[int] = mapped_column(BigInteger, default=0)
    failing_since: Mapped[datetime | None]  # the first failure since the last success
    failures: Mapped[int] = mapped_column(Integer, default=0)  # in a row
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]

    __table_args__ = (Index("ix_webhooks_owner_id", "owner", "id"),)


DUE_DELIVERY = text("status IN ('pending', 'sending')")
LIVE_DELIVERY = text("status IN ('pending', 'sending', 'waiting')")
ENDED_DELIVERY = text("status IN ('delivered', 'failed')")


class WebhookDelivery(Base):
    """One event for one endpoint: pending until sent (retried with backoff until
    ``give_up_at``), then delivered or failed; the endpoint's delivery log."""

    __tablename__ = "webhook_deliveries"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    endpoint_id: Mapped[str] = mapped_column(ForeignKey("webhooks.id", ondelete="CASCADE"))
    event_id: Mapped[int] = mapped_column(ForeignKey("events.id", ondelete="CASCADE"))
    job_id: Mapped[str | None] = mapped_column(String(32))  # the order key: in order per job
    # waiting (behind an earlier live delivery of its job), pending, sending, delivered,
    # failed (gave up)
    status: Mapped[str] = mapped_column(String(16))
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime]  # pending: not before; sending: the claim's lease
    give_up_at: Mapped[datetime]
    last_status: Mapped[int | None] = mapped_column(Integer)  # the endpoint's HTTP status
    last_error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]

    # Partial indexes: a claim walks the due ones (pending, sending: one per job and
    # endpoint at most) in event order; a job's waiting ones are found by its key; neither
    # ever reads the delivered rows that pile up.
    __table_args__ = (
        UniqueConstraint("endpoint_id", "event_id"),
        Index("ix_webhook_deliveries_due_event_id", "event_id",
              postgresql_where=DUE_DELIVERY, sqlite_where=DUE_DELIVERY),
        Index("ix_webhook_deliveries_live_endpoint_job", "endpoint_id", "job_id", "event_id",
              postgresql_where=LIVE_DELIVERY, sqlite_where=LIVE_DELIVERY),
        Index("ix_webhook_deliveries_endpoint_id_id", "endpoint_id", "id"),
        # retention (service.api.scheduling.retention): the ended ones by age, and an old
        # event's deliveries whatever their status
        Index("ix_webhook_deliveries_ended_updated_at", "updated_at",
              postgresql_where=ENDED_DELIVERY, sqlite_where=ENDED_DELIVERY),
        Index("ix_webhook_deliveries_event_id", "event_id"),
    )  # fmt: skip


class Sweep(Base):
    """A hyperparameter search (service.api.sweeps): trials are jobs with ``jobs.sweep`` set.
    ``study`` is the Optuna study (sampler state and trials) as the searcher last committed
    it; ``proposed`` counts the trials made, the compare-and-set guard of every proposal."""

    __tablename__ = "sweeps"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    owner: Mapped[str] = mapped_column(String(128))
    name: Mapped[str] = mapped_column(String(200))
    base: Mapped[dict[str, Any]] = mapped_column(JSON)  # the JobSpec trials start from
    space: Mapped[dict[str, Any]] = mapped_column(JSON)  # dotted path -> distribution
    method: Mapped[str] = mapped_column(String(16))
    metric: Mapped[str] = mapped_column(String(32))
    goal: Mapped[str] = mapped_column(String(8))
    budget: Mapped[int] = mapped_column(Integer)
    parallelism: Mapped[int] = mapped_column(Integer)
    seed: Mapped[int | None] = mapped_column(BigInteger)
    early_stop: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    study: Mapped[bytes | None] = mapped_column(LargeBinary)
    proposed: Mapped[int] = mapped_column(Integer, default=0)
    status: Mapped[str] = mapped_column(String(16))  # running, finished, cancelled
    message: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime]
    ended_at: Mapped[datetime | None]

    __table_args__ = (Index("ix_sweeps_owner_id", "owner", "id"),)


# The tables, typed as such, for Core statements on the hot paths.
JOBS = cast(Table, Job.__table__)
ATTEMPTS = cast(Table, Attempt.__table__)
METRICS = cast(Table, Metric.__table__)
LOGS = cast(Table, LogChunk.__table__)
DATASETS = cast(Table, Dataset.__table__)
DATASET_OWNERS = cast(Table, DatasetOwner.__table__)
JOB_OWNERS = cast(Table, JobOwner.__table__)
OWNER_LIMITS = cast(Table, OwnerLimit.__table__)
EVENTS = cast(Table, EventRecord.__table__)
EVENTS_PRUNED = cast(Table, EventsPruned.__table__)
WEBHOOKS = cast(Table, Webhook.__table__)
WEBHOOK_DELIVERIES = cast(Table, WebhookDelivery.__table__)
SWEEPS = cast(Table, Sweep.__table__)
