"""The service's one settings object, read from ``TRAINQ_*`` environment variables.

Nothing else in ``service/`` reads ``os.environ``; code that needs a setting gets this object
(``create_app(settings)``, ``Ingestor(settings, ...)``), so tests build their own.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["Settings"]


def _default_consumer() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TRAINQ_", extra="ignore")

    # Stores and wires. The embedded default keeps SQLite next to the process, in .trainq/.
    database_url: str = "sqlite:///.trainq/trainq.db"
    redis_url: str = "redis://127.0.0.1:6379/0"  # events, heartbeats, cancel flags, workers
    broker_url: str = "redis://127.0.0.1:6379/1"  # Celery broker: its own database number
    redis_prefix: str = "trainq"
    data_root: Path = Path("data")
    runs_root: Path = Path("runs")
    # The most one job's run folder may hold at worst (trainer.plan's disk estimate:
    # checkpoint.keep checkpoints and their HF folders); above it a submit is a 422. 0: none.
    runs_max_job_bytes: int = Field(512 * 1024**3, ge=0)
    # The most one owner's runs may hold together: the sum of the same estimate over every
    # job of theirs not yet removed (a finished run keeps its folder till then); above it a
    # submit is a 422. 0: none (the default: the room to give depends on the runs disk, and a
    # bound submit skips the group commit, as it locks its owner; service.api.jobs.room).
    runs_max_owner_bytes: int = Field(0, ge=0)

    # Anything but "off" keeps auth on, so a typo never opens the API.
    auth: str = "on"
    # /metrics without a token (for a scraper on a trusted network); else an admin token.
    metrics_public: bool = False
    token_cache_s: float = Field(5.0, ge=0)  # a revoked token stops working within this

    max_body_bytes: int = Field(1024 * 1024, ge=1024)
    # YAML parses ~50x slower than JSON; a spec is a few KB, so this bounds a parse to ~0.1 s.
    max_yaml_bytes: int = Field(64 * 1024, ge=1024)
    # train.tracking.mlflow.tracking_uri may name a loopback, private or link-local address
    # (never a metadata one): off, such a URI is refused at submit (trainer.outbound).
    tracking_allow_private: bool = False
    # Kept open: a connection past the pool size is opened and closed per request (a
    # PostgreSQL backend started each time), so the pool covers a busy worker's concurrency.
    db_pool_size: int = Field(20, ge=1)
    db_max_overflow: int = Field(10, ge=0)
    db_timeout_s: float = Field(5.0, gt=0)  # pool checkout and SQLite busy timeout
    # A full SELECT ping per checkout; off by default, as service.api.core.db already discards
    # connections the server closed without a round trip (see its docstring).
    db_pre_ping: bool = False
    redis_timeout_s: float = Field(2.0, gt=0)

    # Background loops in the API process; tests switch them off and drive them directly.
    ingest: bool = True
    reconcile: bool = True
    consumer_group: str = "trainq-service"
    consumer_name: str = Field(default_factory=_default_consumer)
    ingest_batch: int = Field(500, ge=1, le=100_000)
    ingest_block_ms: int = Field(1000, ge=1)
    # Metric and log entries wait up to this long for more to share their transaction
    # (service.api.streams.ingest.Ingestor._linger); any other entry ends the wait. 0: none.
    ingest_linger_ms: int = Field(500, ge=0, le=10_000)
    ingest_claim_idle_ms: int = Field(30_000, ge=0)  # pending entries of a dead consumer
    reconcile_interval_s: float = Field(2.0, gt=0)
    sweep_interval_s: float = Field(2.0, gt=0)  # the sweeps' pass (service.api.sweeps.sweeper)
    heartbeat_grace_s: float = Field(5.0, ge=0)  # a heartbeat missing this long: lost
    unsent_grace_s: float = Field(5.0, ge=0)  # the request that committed it sends first
    # A sent, unclaimed attempt whose message is in no broker queue (the broker lost its
    # data, a worker died holding it) is sent again once seen missing twice this far apart.
    orphan_check_s: float = Field(10.0, gt=0)
    orphan_scan_max: int = Field(200_000, ge=1)  # broker messages read per check, at most
    worker_stale_s: float = Field(15.0, gt=0)
    dispatch_backoff_s: float = Field(5.0, ge=0)  # after a failed send, requests skip sending

    job_stream_maxlen: int = Field(10_000, ge=10)
    sse_ping_s: float = Field(15.0, gt=0)
    # Events queued for one SSE follower before it counts as too slow and is dropped (it
    # resumes with Last-Event-ID); and the follow Redis pool's size (one per followed job).
    sse_queue_size: int = Field(1024, ge=1)
    sse_redis_connections: int = Field(1000, ge=2)
    # Open event and log streams: per process, and per owner (a token's name); beyond, 429.
    sse_max_streams: int = Field(1000, ge=1)
    sse_max_streams_per_owner: int = Field(32, ge=1)
    # A stream ends after this long (the client resumes with Last-Event-ID), so no stream
    # outlives a policy change by more than this.
    sse_max_lifetime_s: float = Field(3600.0, gt=0)
    # Datasets (service.api.datasets.service): one upload's size, and all of an owner's
    # datasets together (as prepared: 2 bytes a token; service.api.datasets.quota); beyond,
    # 413 naming the setting. Preparations run as at most this many processes at once,
    # shared fairly between owners; an uploading/preparing dataset whose process stops
    # beating for stale_s fails.
    dataset_max_upload_bytes: int = Field(8 * 1024**3, ge=1)
    dataset_max_owner_bytes: int = Field(64 * 1024**3, ge=1)
    dataset_prepare_workers: int = Field(2, ge=1, le=64)
    dataset_heartbeat_s: float = Field(5.0, gt=0)
    dataset_stale_s: float = Field(60.0, gt=0)
    log_line_max_chars: int = Field(8192, ge=80)
    log_chunk_max_lines: int = Field(1000, ge=1)
    # Generation (POST /v1/completions): a worker stops a request this long after it was
    # sent and answers 504; the API stops waiting a little after that.
    generate_timeout_s: float = Field(120.0, gt=0, le=3600)
    # Generation requests one owner may have in flight on one API process (more: 429).
    generate_max_per_owner: int = Field(8, ge=1)
    # A completions call with a list of prompts: how many of its worker requests are sent at
    # once (the rest as earlier ones end); the call holds one in-flight slot however many.
    generate_fanout: int = Field(8, ge=1, le=64)
    # A dataset upload whose body sends nothing for this long is cut (408); and one that has
    # not ended this long after it began, however steadily it sends (408).
    dataset_upload_idle_s: float = Field(60.0, gt=0)
    dataset_upload_max_s: float = Field(3600.0, gt=0)
    # Submit limits per owner (service.api.scheduling.ratelimit); beyond, 429 naming the setting;
    # 0: none. Submits per window (the window is a minute; tests shorten it), counted in Redis.
    submits_per_minute: int = Field(100_000, ge=0)
    submit_window_s: float = Field(60.0, gt=0)
    max_queued_per_owner: int = Field(100_000, ge=0)  # the owner's jobs in status queued

    # Scheduling (service.api.scheduling.admit). "admit": jobs wait in SQL and the admitter places
    # each node on a chosen worker's own queue; "fifo": every job is sent to its queue's shared
    # Celery list at submit, first come first served (the behaviour before admission, kept
    # as the baseline the benchmarks compare against and for a single-team setup).
    scheduler: Literal["admit", "fifo"] = "admit"
    admit_interval_s: float = Field(1.0, gt=0)  # the periodic pass; events wake it sooner
    # Fair share between owners of one priority: slot-seconds used, halved every this long.
    fair_share_half_life_s: float = Field(3600.0, gt=0)
    # A job is preempted at most once per this interval (no thrashing).
    preempt_min_interval_s: float = Field(300.0, ge=0)
    # A job that has yielded this many times is no longer preempted: it runs to its end
    # (0: no budget).
    preempt_max_per_job: int = Field(2, ge=0)
    preemption: bool = True
    # Aging: a waiting job ranks +1 priority per this many seconds waited (0: no aging), at
    # most +priority_aging_max; it only orders admission, never preempts.
    priority_aging_s: float = Field(60.0, ge=0)
    priority_aging_max: int = Field(10, ge=0, le=2000)
    # A gang that still failed to start is requeued after a backoff: base * 2^(n-1), capped.
    gang_backoff_s: float = Field(5.0, ge=0)
    gang_backoff_max_s: float = Field(300.0, ge=0)
    # Owner defaults; ``trainq token limits`` sets one owner's (service.api.scheduling.limits).
    max_priority: int = Field(0, ge=-1000, le=1000)  # the highest priority a token may ask
    max_running_per_owner: int = Field(0, ge=0)  # slots (GPUs on GPU queues) per queue; 0: none
    # Per job: above this many ranks (nodes x procs_per_node) a spec must give max_runtime_s
    # (0: never required); and the deadline given to a spec without one, per queue ("*": any).
    max_runtime_required_ranks: int = Field(0, ge=0)
    default_max_runtime_s: dict[str, int] = Field(default_factory=dict)
    # Retention (service.api.scheduling.retention): finished jobs older than this are deleted with
    # their metrics and logs (0: kept forever); their run folders too when retention_remove_runs.
    retention_days: float = Field(0.0, ge=0)
    retention_remove_runs: bool = False
    retention_interval_s: float = Field(3600.0, gt=0)
    # The same pass prunes events (the feed, the webhooks' outbox) and ended webhook deliveries
    # older than this (0: kept forever); never an event an unfinished delivery still sends.
    events_retention_days: float = Field(30.0, ge=0)

    # Webhooks (service.api.webhooks). Deliveries run as a thread of the API process, or
    # (webhook_deliver false on the API) as their own: python -m service.api.webhooks.delivery.
    webhook_deliver: bool = True
    # Loopback and private addresses as webhook targets (never link-local or metadata).
    webhook_allow_loopback: bool = False
    webhook_timeout_s: float = Field(5.0, gt=0, le=60)  # connect, and each read or write
    webhook_max_response_bytes: int = Field(64 * 1024, ge=0)  # read of an answer, at most
    # Retries: base * 2^(n-1) s after the n-th failure (at most max_s, jittered down to
    # half), until window_s after the event; then the delivery is failed.
    webhook_retry_base_s: float = Field(5.0, gt=0)
    webhook_retry_max_s: float = Field(3600.0, gt=0)
    webhook_retry_window_s: float = Field(86400.0, gt=0)
    # An endpoint failing this many deliveries in a row over at least this long is disabled.
    webhook_disable_failures: int = Field(20, ge=1)
    webhook_disable_after_s: float = Field(86400.0, ge=0)
    # Sends in flight per endpoint (so one slow endpoint holds at most these), all endpoints.
    webhook_per_endpoint: int = Field(4, ge=1, le=64)
    webhook_in_flight: int = Field(512, ge=1)
    webhook_poll_s: float = Field(0.5, gt=0)  # how often an idle deliverer looks for events
    # A claimed delivery is held this long, renewed while its deliverer lives: one that died
    # leaves its deliveries to the others within it.
    webhook_lease_s: float = Field(60.0, ge=1, le=3600)
    # The deliverer's own process (python -m service.api.webhooks.delivery) runs this much
    # nicer than the API (os.nice; 0: as the API), so a backlog of deliveries yields the CPU
    # to requests, at the cost of delivering slower on a busy host.
    webhook_nice: int = Field(0, ge=0, le=19)
    # Deliveries one deliverer (an API's thread, or the process) starts a second, at most
    # (0: no bound): a backlog then drains at this pace instead of at once, so its CPU and
    # database work are spread out and the API's requests keep their latency.
    webhook_max_per_s: float = Field(0.0, ge=0)
    webhook_max_per_owner: int = Field(20, ge=1)

    @model_validator(mode="after")
    def _lease_outlives_passes(self) -> Settings:
        # a living deliverer renews its claims once a pass: a lease shorter than a few idle
        # passes would lapse under it and hand its deliveries to another (sent twice)
        if self.webhook_lease_s < 3 * self.webhook_poll_s:
            raise ValueError(
                f"TRAINQ_WEBHOOK_LEASE_S ({self.webhook_lease_s:g}) must be at least 3 x"
                f" TRAINQ_WEBHOOK_POLL_S ({self.webhook_poll_s:g})"
            )
        return self

    @property
    def auth_enabled(self) -> bool:
        return self.auth.strip().lower() != "off"
