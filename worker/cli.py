"""Starts a worker: `trainq worker` (service/cli/main.py) and `python -m worker` both land here."""

from __future__ import annotations

import argparse
import re

from worker.context import WorkerContext
from worker.message import QUEUE_PATTERN, WORKER_NAME_PATTERN, broker_queue, worker_queue
from worker.settings import WorkerSettings

__all__ = ["main", "run"]


def run(
    queues: list[str],
    slots: int,
    gpus: list[int] | None,
    hostname: str | None,
    advertise_host: str | None = None,
) -> None:
    """Run a Celery worker for ``queues`` with ``slots`` concurrent attempts until shut down.

    The pool is the app's (worker.pool): threads, as a task only waits on its torchrun.
    """
    queues = [q.strip() for q in queues if q.strip()]
    if not queues:
        raise ValueError("a worker needs at least one queue")
    for queue in queues:
        if not re.fullmatch(QUEUE_PATTERN, queue):
            raise ValueError(
                f"queue name {queue!r} must be 1-64 letters, digits, '.', '_' or '-',"
                " starting with a letter or digit"
            )
    from worker.celery_app import app, configure

    settings = WorkerSettings()
    if advertise_host:
        settings = settings.model_copy(update={"advertise_host": advertise_host})
    ctx = WorkerContext(settings, queues=queues, slots=slots, gpus=gpus, name=hostname)
    if not re.fullmatch(WORKER_NAME_PATTERN, ctx.name):
        raise ValueError(
            f"worker name {ctx.name!r} must be 1-128 letters, digits, '.', '_' or '-',"
            " starting with a letter or digit (give one with --hostname)"
        )
    configure(ctx)
    # Its spec queues (the service's fifo scheduler sends there) and its own queue (the
    # admitter sends each node it placed on this worker there).
    broker = [broker_queue(q, settings.redis_prefix) for q in queues]
    broker.append(worker_queue(ctx.name, settings.redis_prefix))
    app.worker_main(
        [
            "worker",
            f"--queues={','.join(broker)}",
            f"--concurrency={slots}",
            f"--hostname=trainq@{ctx.name}",
            "--loglevel=INFO",
            # No broadcast chatter between workers: trainq's registry lives in Redis.
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ]
    )


def _ints(text: str) -> list[int]:
    return [int(p) for p in text.split(",") if p.strip()]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m worker", description=run.__doc__)
    p.add_argument("--queues", required=True, help="comma-separated queue names")
    p.add_argument("--slots", type=int, default=1)
    p.add_argument("--gpus", type=_ints, default=None, help="comma-separated GPU indices")
    p.add_argument("--hostname", default=None)
    p.add_argument(
        "--advertise-host",
        default=None,
        help="the address other hosts reach this one at (default: TRAINQ_ADVERTISE_HOST, else"
        " the address of the interface that reaches the broker)",
    )
    a = p.parse_args(argv)
    try:
        run(a.queues.split(","), a.slots, a.gpus, a.hostname, a.advertise_host)
    except ValueError as exc:
        p.error(str(exc))
