"""The worker's one settings object, read from ``TRAINQ_*`` environment variables.

A worker runs user workloads on a GPU host, so it holds no database credentials: only the
events Redis (heartbeats, cancel flags, events), the Celery broker and two folders.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["WorkerSettings"]


class WorkerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TRAINQ_", extra="ignore")

    redis_url: str = "redis://127.0.0.1:6379/0"  # events, heartbeats, cancel flags, registry
    broker_url: str = "redis://127.0.0.1:6379/1"  # Celery broker: its own database number
    redis_prefix: str = "trainq"
    # The URL handed to the ranks (rank 0 publishes metrics with it); default: redis_url.
    # torchrun gives every rank the same environment, so every rank can read it: make it a
    # Redis ACL user that may only XADD to the trainq streams (worker.launch.build_env).
    rank_redis_url: str | None = None
    data_root: Path = Path("data")
    runs_root: Path = Path("runs")

    heartbeat_ttl_s: float = Field(10.0, gt=0)  # refreshed every ttl/3
    # Once an attempt's exit event is sent, its heartbeat is replaced by an "exited" marker
    # that lives this long: the service does not call the attempt lost while its exit waits
    # to be ingested (an API under load, or down for less than this).
    exit_marker_ttl_s: float = Field(3600.0, gt=0)
    cancel_grace_s: float = Field(30.0, ge=0)  # SIGTERM, then this long, then SIGKILL
    cancel_poll_s: float = Field(1.0, gt=0)  # the cancel key is polled; pub/sub only wakes
    registry_interval_s: float = Field(5.0, gt=0)
    # The ranks one slot of a CPU worker holds (procs_per_node above it is not placed here);
    # a GPU worker's slot holds as many ranks as it has GPUs.
    slot_procs: int = Field(8, ge=1, le=64)
    max_restarts: int = Field(0, ge=0, le=100)  # torchrun --max-restarts per attempt
    log_batch_lines: int = Field(200, ge=1)
    log_batch_s: float = Field(0.25, gt=0)
    log_tail_lines: int = Field(20, ge=1)  # last lines quoted in an exit_code message
    # Lines an attempt forwards as they come; past that only its last log_keep_last lines,
    # after a line saying how many were not kept (a runaway print costs a bounded amount).
    log_max_lines: int = Field(200_000, ge=1)
    log_keep_last: int = Field(2_000, ge=0)
    flush_timeout_s: float = Field(10.0, gt=0)  # how long the exit waits for Redis
    python: str | None = None  # interpreter for torchrun and the guard; default: ours
    # Trackers at loopback/private addresses allowed for the runs (trainer.tracking checks it
    # again before it connects; the service checks at submit with its own setting).
    tracking_allow_private: bool = False
    # Per-owner tracker credentials an admin sets on this host: TRACKING_SECRETS/OWNER/
    # WANDB_API_KEY (and MLFLOW_TRACKING_TOKEN, ...), for that owner's runs only.
    tracking_secrets: Path | None = None
    # Multi-node: how long a node waits for the rest of its gang before the attempt fails
    # (no_worker), and the address other hosts reach this one at (node 0 hosts the
    # rendezvous store); default: the address of the interface that reaches the broker
    # (worker.address), whose interface gloo/NCCL are told to use too.
    gang_timeout_s: float = Field(120.0, gt=0)
    advertise_host: str | None = None
    # Generation (worker.generate): its own threads beside the training slots; loaded
    # checkpoints kept in an LRU bounded by this many bytes of weights; the torch device.
    generate_threads: int = Field(1, ge=1, le=16)
    generate_cache_bytes: int = Field(2 * 1024**3, ge=0)
    generate_device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d{1,2})?|mps)$")
    # torch's intra-op threads for generation (None: torch's default, one per core). On a
    # host whose cores the training ranks keep busy, 1 avoids threads spinning on each other.
    generate_torch_threads: int | None = Field(None, ge=1, le=256)
    # Requests a worker takes off its queues' streams ahead of its generation threads, so
    # that it can serve owners in turn (worker.genqueue) rather than in arrival order.
    generate_backlog: int = Field(32, ge=1, le=1024)
    # Requests to one model decoded together (one forward per token for all); 1: one at a
    # time. A request waiting joins the batch at the next token (hf family: at its start).
    generate_batch: int = Field(8, ge=1, le=256)
