"""The Celery app of a trainq worker: Redis broker on its own database, early ack, prefetch 1.

Celery only carries the job message. Early ack on purpose: a redelivered message is not
our recovery path (a lost attempt is found by its expired heartbeat and retried as a new
attempt by the service), and the claim makes any stray redelivery a no-op anyway.
Queues are declared explicitly, one per trainq queue, exactly as the service's
``send_task(..., queue=name)`` creates them (direct exchange and routing key = name), where
``name`` is the queue's broker name (``worker.message.broker_queue``: ``trainq.{queue}``).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Sequence
from typing import Any

from celery import Celery, signals
from kombu import Exchange, Queue

from trainer.publish import start_warning
from worker.context import WorkerContext
from worker.generate import GenerationServer
from worker.intake import Intake
from worker.message import broker_queue, spec_queue, worker_queue
from worker.registry import Registry
from worker.settings import WorkerSettings

__all__ = ["app", "configure", "context"]

log = logging.getLogger(__name__)

# TCP keepalive on every broker connection: an idle one whose peer is gone (a host cut off,
# a NAT or Redis that forgot it) is found dead within 10 + 3 x 5 = 25 s. kombu leaves it
# off, and the kernel's default would wait 2 hours. Linux names; skipped where absent.
KEEPALIVE = {
    getattr(socket, name): value
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3))
    if hasattr(socket, name)
}
# kombu's Redis transport waits forever by default. With these, a command on a dead
# connection (the event loop's own: restoring unacked messages, declaring a queue the intake
# resumes; or a task handed back) fails within 10 s rather than blocking the consumer's loop
# until TCP gives up (minutes; after a long cut, TCP's backed-off retransmission can come up
# to 2 minutes after the link is back), a connect to a host that does not answer fails within
# 5 s and is retried, and a BRPOP whose reply is overdue by more than 10 s is dropped and sent
# again (kombu checks every health_check_interval: within 1 + 2 x 10 = 21 s).
BROKER_TRANSPORT_OPTIONS = {
    "socket_connect_timeout": 5,
    "socket_timeout": 10,  # > the BRPOP's own 1 s (kombu's brpop_timeout), read when readable
    "socket_keepalive": True,
    "socket_keepalive_options": KEEPALIVE,
    "health_check_interval": 10,
}

app = Celery("trainq", include=["worker.tasks"])
app.conf.update(
    broker_url=WorkerSettings().broker_url,
    task_acks_late=False,
    worker_prefetch_multiplier=1,
    # With early ack a busy worker would still reserve one more message; for a gang that
    # message may be another node of the attempt it runs, which then waits out the gang.
    # A worker takes a message only when a slot is free.
    worker_disable_prefetch=True,
    # Celery's threads pool (a task only waits on its torchrun, whose processes live in
    # their own process group: no forked child is needed), plus a wake-up of the event loop
    # as each task ends, so a freed slot takes its next message at once (worker.pool).
    worker_pool="worker.pool:ThreadPool",
    task_create_missing_queues=False,
    task_ignore_result=True,
    result_backend=None,
    worker_send_task_events=False,
    worker_hijack_root_logger=True,
    broker_connection_retry_on_startup=True,
    broker_transport_options=BROKER_TRANSPORT_OPTIONS,
    # A broker blip must not cancel a run in progress (and early-acked tasks are not redone).
    worker_cancel_long_running_tasks_on_connection_loss=False,
)


_context: WorkerContext | None = None


def queues_for(
    names: Sequence[str], prefix: str = "trainq", worker: str | None = None
) -> list[Queue]:
    """The broker queues for trainq queues ``names`` (each under the prefix), and
    ``worker``'s own queue (``worker.message.worker_queue``) if given."""
    broker = [broker_queue(n, prefix) for n in names]
    if worker is not None:
        broker.append(worker_queue(worker, prefix))
    return [Queue(b, Exchange(b, type="direct"), routing_key=b) for b in broker]


def configure(ctx: WorkerContext) -> Registry:
    """Point the app at this worker's broker and queues, and hook its lifecycle signals."""
    global _context
    _context = ctx
    app.conf.update(
        broker_url=ctx.settings.broker_url,
        task_queues=queues_for(ctx.queues, ctx.settings.redis_prefix, ctx.name),
        task_default_queue=broker_queue(ctx.queues[0], ctx.settings.redis_prefix),
    )
    intake = Intake()  # no consuming while Redis is out of reach; the registry finds out
    registry = Registry(ctx, on_reach=intake.follow)
    generation = GenerationServer(ctx)  # its threads import torch when a request comes

    def on_ready(sender: Any = None, **_: Any) -> None:
        if sender is not None:  # the consumer
            intake.attach(sender)
        registry.start()
        generation.start()
        # Said once here rather than found per job: the host lacks what hf folders need.
        if (warning := start_warning()) is not None:
            log.warning(warning)

    def on_shutting_down(**_: Any) -> None:
        # Warm shutdown (SIGTERM): Celery stops taking tasks and waits for the running ones;
        # we make those end now, checkpointed, and report them preempted.
        ctx.shut_down()

    def on_shutdown(**_: Any) -> None:
        generation.stop()
        registry.stop()

    signals.worker_ready.connect(on_ready, weak=False)
    signals.worker_shutting_down.connect(on_shutting_down, weak=False)
    signals.worker_shutdown.connect(on_shutdown, weak=False)
    return registry


def context() -> WorkerContext:
    """The running worker's context (built from settings if started by plain `celery`)."""
    global _context
    if _context is None:
        settings = WorkerSettings()
        names = [
            spec_queue(q.name, settings.redis_prefix)
            for q in app.conf.task_queues or ()
            if not q.name.startswith(f"{settings.redis_prefix}.@")  # a worker's own queue
        ]
        _context = WorkerContext(settings, queues=names or ["default"])
    return _context
