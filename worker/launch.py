"""Builds what a run is started with: the guard + torchrun argv list and the allow-listed env.

Nothing here touches a shell: every value from a job spec ends up as one argv item, and the
environment handed to torchrun (and so to every rank) is built from an allow-list, so broker
URLs and other credentials of the worker never reach user code.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = [
    "ENV_PASSTHROUGH",
    "ENV_PASSTHROUGH_PREFIXES",
    "LOG_LINE_PREFIX",
    "build_env",
    "build_guard_argv",
    "build_torchrun_argv",
    "safe_job_id",
]

# Variables copied from the worker's own environment when set; everything else is dropped.
ENV_PASSTHROUGH = ("PATH", "PYTHONPATH", "HOME", "LANG", "OMP_NUM_THREADS")
# Debug knobs of NCCL and PyTorch (NCCL_DEBUG, TORCH_DISTRIBUTED_DEBUG, TORCH_LOGS, ...).
ENV_PASSTHROUGH_PREFIXES = ("NCCL_", "TORCH_")

# torchrun prefixes every teed rank line with this (global rank), so the worker can tag lines;
# torchrun's own lines carry no prefix.
LOG_LINE_PREFIX = "[rank${rank}]:"

_JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
GUARD = Path(__file__).with_name("guard.py")


def safe_job_id(job_id: str) -> bool:
    """A job id becomes a folder name under the runs root: no separators, no dot names."""
    return bool(_JOB_ID.fullmatch(job_id)) and ".." not in job_id


def build_torchrun_argv(
    python: str,
    *,
    nnodes: int,
    nproc_per_node: int,
    max_restarts: int,
    config: Path,
    run_dir: Path,
    data_root: Path,
    log_dir: Path,
    rdzv_endpoint: str | None = None,
    rdzv_id: str | None = None,
    node_rank: int = 0,
) -> list[str]:
    """torchrun's argv: one node uses --standalone; several share a static rendezvous.

    Static, not c10d: the gang (worker.gang) has already gathered every node, and c10d
    would ignore ``--node-rank`` and order the nodes by host and pid, while static keeps
    node n's ranks at ``n * nproc_per_node ...``, so global rank 0 (the one that reports
    metrics) runs on node 0, whose agent hosts the store at the endpoint.
    """
    argv = [
        python,
        "-m",
        "trainer.torchrun",  # torch.distributed.run, with a faster exit
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc_per_node}",
    ]
    if nnodes == 1 and rdzv_endpoint is None:
        argv.append("--standalone")
    else:
        if not rdzv_endpoint or not rdzv_id:
            raise ValueError("a multi-node launch needs a rendezvous endpoint and id")
        if not 0 <= node_rank < nnodes:
            raise ValueError(f"node rank {node_rank} is not below nnodes={nnodes}")
        argv += [
            "--rdzv-backend=static",
            f"--rdzv-endpoint={rdzv_endpoint}",
            f"--rdzv-id={rdzv_id}",
            f"--node-rank={node_rank}",
        ]
    argv += [
        f"--max-restarts={max_restarts}",
        # Tee every rank's stdout and stderr into log files *and* torchrun's own streams, where
        # the worker reads them with the rank prefix.
        "--tee=3",
        f"--log-dir={log_dir}",
        "-m",
        "trainer",
        "--config",
        str(config),
        "--run-dir",
        str(run_dir),
        "--data-root",
        str(data_root),
    ]
    return argv


def build_guard_argv(python: str, torchrun_argv: Sequence[str]) -> list[str]:
    """The guard runs torchrun as its child; -I -S keep its start fast (stdlib only)."""
    return [python, "-I", "-S", str(GUARD), "--", *torchrun_argv]


def build_env(
    parent: Mapping[str, str],
    *,
    gpus: Sequence[int] | None,
    redis_url: str,
    redis_prefix: str,
    job_id: str,
    attempt: int,
) -> dict[str, str]:
    """The run's environment: allow-listed parent variables plus what the trainer needs.

    ``gpus=None`` (a CPU slot) hides every GPU rather than exposing all of them.
    """
    # torchrun's shared rendezvous TCPStore keeps the previous round's keys, so ranks
    # restarted by --max-restarts can read stale peer addresses and fail to connect
    # (pytorch/pytorch#135712); a fresh store per round avoids it. The parent may override.
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    env.update({k: parent[k] for k in ENV_PASSTHROUGH if k in parent})
    env.update({k: v for k, v in parent.items() if k.startswith(ENV_PASSTHROUGH_PREFIXES)})
    env.update(
        {
            "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in gpus or ()),
            "TRAINQ_REDIS_URL": redis_url,
            "TRAINQ_REDIS_PREFIX": redis_prefix,
            "TRAINQ_JOB_ID": job_id,
            "TRAINQ_ATTEMPT": str(attempt),
            # Ranks write into teed files; unbuffered output keeps lines flowing live.
            "PYTHONUNBUFFERED": "1",
            "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": LOG_LINE_PREFIX,
        }
    )
    return env
