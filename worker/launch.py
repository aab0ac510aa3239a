"""Builds what a run is started with: the guard + torchrun argv list and the allow-listed env.

Nothing here touches a shell: every value from a job spec ends up as one argv item, and the
environment handed to torchrun (and so to every rank) is built from an allow-list of names,
so broker URLs and other credentials of the worker never reach the ranks.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "ENV_LIBRARY",
    "ENV_PASSTHROUGH",
    "ENV_TRACKING",
    "LOG_LINE_PREFIX",
    "build_env",
    "build_guard_argv",
    "build_torchrun_argv",
    "omp_threads",
    "owner_secrets",
    "safe_job_id",
    "trackers_of",
]

# Variables copied from the worker's own environment when set; everything else is dropped.
# OMP_NUM_THREADS set on the worker is the operator's choice and wins over omp_threads().
ENV_PASSTHROUGH = ("PATH", "PYTHONPATH", "HOME", "LANG", "OMP_NUM_THREADS")

# The knobs of the libraries a rank runs on, copied when set on the worker: names, not
# prefixes. A prefix handed every TORCH_* / NCCL_* variable of the worker to the ranks,
# whatever it held (a token that some other tool keeps there, a knob nobody reviewed that
# changes every run). A name missing here is one line to add.
ENV_LIBRARY = (
    # NCCL: which fabric the GPU collectives use (a cluster has to name its interface,
    # InfiniBand HCAs and GPUDirect level; a faulty link is switched off here), and NCCL's
    # debug output, the first thing asked for when a collective hangs.
    *("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE"),
    *("NCCL_SOCKET_IFNAME", "NCCL_SOCKET_FAMILY", "NCCL_SOCKET_NTHREADS", "NCCL_NSOCKS_PERTHREAD"),
    *("NCCL_IB_DISABLE", "NCCL_IB_HCA", "NCCL_IB_GID_INDEX", "NCCL_IB_TC", "NCCL_IB_SL"),
    *("NCCL_IB_TIMEOUT", "NCCL_IB_RETRY_CNT", "NCCL_NET", "NCCL_NET_PLUGIN"),
    *("NCCL_NET_GDR_LEVEL", "NCCL_CROSS_NIC", "NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL"),
    *("NCCL_SHM_DISABLE", "NCCL_TOPO_FILE", "NCCL_ALGO", "NCCL_PROTO", "NCCL_BUFFSIZE"),
    *("NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS"),
    # gloo (CPU collectives): the interface of a multi-node CPU run, as NCCL_SOCKET_IFNAME.
    "GLOO_SOCKET_IFNAME",
    # PyTorch's distributed runtime: its debug checks and logs, and how c10d handles NCCL
    # errors and hangs (the TORCH_NCCL_* names; the NCCL_* spellings are deprecated).
    *("TORCH_DISTRIBUTED_DEBUG", "TORCH_CPP_LOG_LEVEL", "TORCH_LOGS", "TORCH_SHOW_CPP_STACKTRACES"),
    *("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT", "TORCH_NCCL_DUMP_ON_TIMEOUT"),
    *("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_ENABLE_MONITORING"),
    *("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "TORCH_NCCL_AVOID_RECORD_STREAMS"),
    # torchrun's rendezvous store: build_env sets it (see there); an operator may override.
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
    # Where torch and torch.compile keep their caches: a host's local disk, not $HOME.
    *("TORCH_HOME", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"),
    # CUDA: the caching allocator's settings (fragmentation is a common cause of OOM),
    # synchronous launches to find a failing kernel, lazy module loading, the JIT cache.
    # Never CUDA_VISIBLE_DEVICES: the slot decides which GPUs a run sees.
    *("PYTORCH_CUDA_ALLOC_CONF", "CUDA_LAUNCH_BLOCKING", "CUDA_MODULE_LOADING"),
    *("CUDA_DEVICE_MAX_CONNECTIONS", "CUDA_CACHE_PATH"),
)

# The experiment trackers' credentials (trainer.tracking), copied only into the runs whose
# spec names that tracker: a run that logs nowhere never sees a tracker's key.
ENV_TRACKING: dict[str, tuple[str, ...]] = {
    "wandb": ("WANDB_API_KEY", "WANDB_BASE_URL"),
    "mlflow": ("MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"),
}

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


def omp_threads(cpus: int, slots: int, procs_per_node: int) -> int:
    """OMP_NUM_THREADS of each rank: the slot's share of the worker's CPUs, split among the
    slot's ranks (at least 1).

    Each rank runs torch's intra-op thread pool, as wide as the machine unless told: N
    ranks would oversubscribe the cores N times over, and crowd the runs of the other
    slots. Unset, torchrun picks 1 instead, with a banner at the top of every run's log,
    which leaves a CPU run, and the host side of a GPU run, one core per rank however many
    the slot has. The worker's slots share its CPUs equally, as they share its GPUs.
    """
    return max(1, cpus // max(1, slots) // max(1, procs_per_node))


def trackers_of(train: Any) -> list[str]:
    """The trackers a ``TrainConfig`` names (``train.tracking``), as ``ENV_TRACKING``'s keys."""
    tracking = getattr(train, "tracking", None)
    return [name for name in ENV_TRACKING if getattr(tracking, name, None) is not None]


_OWNER = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,127}")
MAX_SECRET_BYTES = 4096


def owner_secrets(root: Path | None, owner: str | None, trackers: Sequence[str]) -> dict[str, str]:
    """The owner's own tracker credentials, set by an admin as files on the worker host:
    ``root/OWNER/WANDB_API_KEY`` and the other ``ENV_TRACKING`` names of ``trackers`` (one
    value a file, no link followed). They win over the worker's environment for its runs.
    An owner whose name is not a plain file name has none."""
    if root is None or owner is None or not _OWNER.fullmatch(owner) or ".." in owner:
        return {}
    found: dict[str, str] = {}
    for name in (n for t in trackers for n in ENV_TRACKING[t]):
        try:
            fd = os.open(root / owner / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:  # none set, or a link
            continue
        with os.fdopen(fd, "rb") as f:
            raw = f.read(MAX_SECRET_BYTES + 1)
        value = raw.decode("utf-8", "replace").strip()
        if value and len(raw) <= MAX_SECRET_BYTES and not any(c in value for c in "\0\r\n"):
            found[name] = value
    return found


def build_env(
    parent: Mapping[str, str],
    *,
    gpus: Sequence[int] | None,
    redis_url: str,
    redis_prefix: str,
    job_id: str,
    attempt: int,
    threads: int,
    ifname: str | None = None,
    trackers: Sequence[str] = (),
    tracking_allow_private: bool = False,
    secrets: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The run's environment: allow-listed parent variables plus what the trainer needs.

    ``gpus=None`` (a CPU slot) hides every GPU rather than exposing all of them. ``threads``
    is OMP_NUM_THREADS (`omp_threads`) unless the worker's own environment sets it.
    ``ifname``: the interface of the address the worker advertises (worker.address), given
    to gloo and NCCL as their socket interface unless the worker's environment names one.
    ``trackers``: the trackers the spec names (``ENV_TRACKING``'s keys), whose credentials
    the run gets from the worker's environment, or from ``secrets`` (``owner_secrets``).
    """
    # torchrun's shared rendezvous TCPStore keeps the previous round's keys, so ranks
    # restarted by --max-restarts can read stale peer addresses and fail to connect
    # (pytorch/pytorch#135712); a fresh store per round avoids it. The parent may override.
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": str(threads)}
    if ifname:
        env.update(GLOO_SOCKET_IFNAME=ifname, NCCL_SOCKET_IFNAME=ifname)
    env.update({k: parent[k] for k in (*ENV_PASSTHROUGH, *ENV_LIBRARY) if k in parent})
    for tracker in trackers:
        env.update({k: parent[k] for k in ENV_TRACKING[tracker] if k in parent})
    env.update(secrets or {})
    if tracking_allow_private:
        env["TRAINQ_TRACKING_ALLOW_PRIVATE"] = "1"
    env.update(
        {
            "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in gpus or ()),
            # Only rank 0 publishes to Redis, but torchrun gives all its ranks one
            # environment: there is no handing a variable to one rank. So every rank can
            # read this URL, password included. What limits it is the account in it: the
            # worker's setting TRAINQ_RANK_REDIS_URL (the worker itself needs far more)
            # naming a Redis ACL user that may only XADD to the trainq streams:
            #   ACL SETUSER trainq-rank on >PASSWORD resetkeys ~trainq:events
            #       ~trainq:job:* ~trainq:fence:* resetchannels -@all +xadd +multi +exec
            #       +select +eval +hget +hset
            # (the trainer's Publisher: one MULTI of XADDs per batch; rank 0's fence check
            # before a checkpoint, trainer.fence: one EVAL on the job's fence key).
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
