"""Group commit of submits (service.api.jobs.submit): concurrent POSTs share commits and broker
writes, each answered only once its row is committed and its attempt sent; a row the database
refuses fails alone; Dispatcher.send_batch puts on the broker what send_attempt does."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import redis as redis_lib
from sqlalchemy import text

from service.api.app import create_app
from service.api.core.settings import Settings
from service.api.scheduling.dispatch import Dispatcher
from tests.api.support import Api, Uvicorn, closed_url
from worker.message import JobMessage


def _broker(api: Api) -> list[dict[str, Any]]:
    broker = redis_lib.Redis.from_url(api.settings.broker_url)
    try:
        return [json.loads(raw) for raw in broker.lrange(api.broker_queue, 0, -1)]
    finally:
        broker.close()


def _job_id(message: dict[str, Any]) -> str:
    args, _kwargs, _embed = json.loads(base64.b64decode(message["body"]))
    return JobMessage.from_json(args[0]).job_id


def test_concurrent_submits_share_commits_and_are_all_sent(
    api: Api, make_settings: Callable[..., Settings]
) -> None:
    app = create_app(make_settings(redis_prefix=api.settings.redis_prefix))
    headers = api.headers()
    names = [f"job-{i}" for i in range(96)] + ["nul \x00 in the name"]

    with Uvicorn(app) as server, httpx.Client(base_url=server.url, timeout=30) as client:

        def submit(name: str) -> httpx.Response:
            body = {"name": name, "queue": api.queue, "train": {"steps": 2}}
            return client.post("/v1/jobs", json=body, headers=headers)

        with ThreadPoolExecutor(max_workers=32) as pool:
            responses = list(pool.map(submit, names))

    *good, bad = responses
    assert [r.status_code for r in good] == [201] * 96, [r.text for r in good if r.is_error]
    assert not bad.is_success  # refused by the database, alone: the rest of its batch went in
    ids = {r.json()["id"] for r in good}
    with api.services.engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT j.id, j.xmin::text, a.sent_at FROM jobs j JOIN attempts a"
                " ON a.job_id = j.id AND a.number = 1 WHERE j.owner = :owner"
            ),
            {"owner": api.user},
        ).all()
    assert {r[0] for r in rows} == ids
    assert all(r[2] is not None for r in rows)  # sent, and marked so before the 201
    # Rows committed by one transaction share its id: fewer commits than jobs.
    assert len({r[1] for r in rows}) < len(ids)
    assert sorted(_job_id(m) for m in _broker(api)) == sorted(ids)


def _sent(message: dict[str, Any]) -> tuple[str, int, int]:
    args, _kwargs, _embed = json.loads(base64.b64decode(message["body"]))
    m = JobMessage.from_json(args[0])
    return m.job_id, m.attempt, m.node_rank


def test_send_batch_writes_what_send_attempt_writes(api: Api) -> None:
    two = api.submit(nodes=2)  # sent by the app's group commit: a message per node
    one = api.submit()
    dispatcher = Dispatcher(api.settings)
    try:
        assert dispatcher.send_batch([two, one], 2) == 2
        assert dispatcher.send_batch([], 2) == 0
    finally:
        dispatcher.close()
    messages = _broker(api)
    assert sorted(_sent(m) for m in messages) == sorted(
        [(two["id"], a, n) for a in (1, 2) for n in (0, 1)] + [(one["id"], a, 0) for a in (1, 2)]
    )
    # The same envelope, headers and properties (apart from ids) as Celery's own send.
    first, *others = messages
    for message in others:
        assert message.keys() == first.keys()
        assert message["headers"].keys() == first["headers"].keys()
        assert message["properties"].keys() == first["properties"].keys()
        assert message["headers"]["task"] == first["headers"]["task"]


def test_send_batch_to_a_dead_broker_sends_none(make_settings: Callable[..., Settings]) -> None:
    dispatcher = Dispatcher(make_settings(broker_url=closed_url("redis")))
    row = {
        "id": "ab12",
        "queue": "q",
        "nodes": 2,
        "procs_per_node": 1,
        "max_runtime_s": None,
        "train": {"steps": 1},
    }
    try:
        assert dispatcher.send_batch([row, row], 1) == 0
    finally:
        dispatcher.close()
