"""The Celery task: as thin as a view. Parse the job message, run the attempt."""

from __future__ import annotations

import logging
from typing import Any

from pydantic import ValidationError

from worker.celery_app import app, context
from worker.message import TASK_NAME, JobMessage, broker_queue, message_tag
from worker.supervise import Unreachable, run_attempt

log = logging.getLogger(__name__)


@app.task(name=TASK_NAME, ignore_result=True, bind=True)
def run_attempt_task(self: Any, payload: dict[str, Any]) -> None:
    try:
        msg = JobMessage.from_json(payload)
    except ValidationError as exc:
        # No job to report on: the message itself is broken (a version skew with the service).
        log.error("dropping a malformed job message: %s", exc)
        return
    ctx = context()
    try:
        run_attempt(msg, ctx)
    except Unreachable as exc:
        # Nothing was started. Early ack took the message off its queue: it goes
        # back there, for a worker that reaches Redis (this one stops consuming meanwhile,
        # worker.intake), rather than being dropped.
        info = self.request.delivery_info or {}
        queue = info.get("routing_key") or broker_queue(msg.queue, ctx.settings.redis_prefix)
        log.error("%s; the task goes back to queue %s", exc, queue)
        app.send_task(
            TASK_NAME,
            args=[payload],
            queue=queue,
            argsrepr=message_tag(msg.job_id, msg.attempt, msg.node_rank),
            kwargsrepr="{}",
        )
