"""The Celery task: as thin as a view. Parse the job message, run the attempt."""

from __future__ import annotations

import logging
from typing import Any

from pydantic import ValidationError

from worker.celery_app import app, context
from worker.message import TASK_NAME, JobMessage
from worker.supervise import run_attempt

log = logging.getLogger(__name__)


@app.task(name=TASK_NAME, ignore_result=True)
def run_attempt_task(payload: dict[str, Any]) -> None:
    try:
        msg = JobMessage.from_json(payload)
    except ValidationError as exc:
        # No job to report on: the message itself is broken (a version skew with the service).
        log.error("dropping a malformed job message: %s", exc)
        return
    run_attempt(msg, context())
