"""Submitting, reading, listing jobs; idempotency keys; dispatch onto the real broker."""

from __future__ import annotations

import base64
import json
import re
from typing import Any

import redis as redis_lib
import yaml

from tests.api.support import Api, register_worker
from worker.message import TASK_NAME, JobMessage


def _broker_messages(api: Api, queue: str) -> list[dict[str, Any]]:
    broker = redis_lib.Redis.from_url(api.settings.broker_url)
    try:
        return [json.loads(raw) for raw in broker.lrange(queue, 0, -1)]
    finally:
        broker.close()


def _decode_task(message: dict[str, Any]) -> tuple[str, JobMessage]:
    # kombu's Redis transport: a JSON envelope, the Celery protocol-2 body base64-encoded.
    body = json.loads(base64.b64decode(message["body"]))
    args, _kwargs, _embed = body
    return message["headers"]["task"], JobMessage.from_json(args[0])


def test_submit_commits_and_sends_to_the_queue(api: Api) -> None:
    job = api.submit(name="first", labels={"team": "nlp"}, retries=2)
    assert job["status"] == "queued"
    assert job["owner"] == api.user
    assert job["attempt"] == 1 and job["attempts"][0]["status"] == "dispatched"
    assert job["train"]["steps"] == 5 and job["train"]["model"]["n_layer"] == 2

    messages = _broker_messages(api, api.broker_queue)
    assert len(messages) == 1
    task, message = _decode_task(messages[0])
    assert task == TASK_NAME
    assert message.job_id == job["id"] and message.attempt == 1 and message.queue == api.queue
    assert message.train.steps == 5

    got = api.get(job["id"])
    assert got["name"] == "first" and got["labels"] == {"team": "nlp"} and got["retries"] == 2
    assert got["attempts"][0]["number"] == 1
    with api.services.sessions() as session:
        from sqlalchemy import select

        from service.api.core.models import ATTEMPTS

        sent = session.execute(
            select(ATTEMPTS.c.sent_at).where(ATTEMPTS.c.job_id == job["id"])
        ).scalar_one()
    assert sent is not None


def test_yaml_body(api: Api) -> None:
    spec = {"name": "from-yaml", "queue": api.queue, "train": {"steps": 7, "strategy": "fsdp"}}
    resp = api.client.post(
        "/v1/jobs",
        content=yaml.safe_dump(spec),
        headers={**api.headers(), "Content-Type": "application/yaml"},
    )
    assert resp.status_code == 201, resp.text
    assert resp.json()["train"]["strategy"] == "fsdp" and resp.json()["name"] == "from-yaml"


def test_idempotency_key_same_spec_200_other_spec_409(api: Api) -> None:
    body = {"name": "idem", "queue": api.queue, "train": {"steps": 3}}
    headers = {**api.headers(), "Idempotency-Key": "build-1234"}
    first = api.client.post("/v1/jobs", json=body, headers=headers)
    assert first.status_code == 201
    # Same spec, keys in another order and a default spelled out: still the same spec.
    same = {"train": {"steps": 3, "seed": 42}, "queue": api.queue, "name": "idem"}
    again = api.client.post("/v1/jobs", json=same, headers=headers)
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
    other = api.client.post("/v1/jobs", json={**body, "name": "changed"}, headers=headers)
    assert other.status_code == 409 and "different spec" in other.json()["detail"]
    # The key is per owner: another token may use it for its own job.
    theirs = api.client.post(
        "/v1/jobs",
        json=body,
        headers={**api.headers(api.other_token), "Idempotency-Key": "build-1234"},
    )
    assert theirs.status_code == 201 and theirs.json()["id"] != first.json()["id"]
    assert len(_broker_messages(api, api.broker_queue)) == 2  # the replay sent nothing


def test_list_newest_first_filters_and_keyset_cursor(api: Api) -> None:
    ids = [api.submit(name=f"n{i}", labels={"parity": str(i % 2)})["id"] for i in range(7)]
    seen: list[str] = []
    cursor = None
    for _ in range(10):
        params: dict[str, Any] = {"limit": 3}
        if cursor:
            params["cursor"] = cursor
        page = api.client.get("/v1/jobs", params=params, headers=api.headers()).json()
        seen += [item["id"] for item in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == list(reversed(ids))

    odd = api.client.get("/v1/jobs", params={"label": "parity:1"}, headers=api.headers()).json()
    assert [i["id"] for i in odd["items"]] == [ids[5], ids[3], ids[1]]
    named = api.client.get("/v1/jobs", params={"name": "n4"}, headers=api.headers()).json()
    assert [i["id"] for i in named["items"]] == [ids[4]]
    queued = api.client.get("/v1/jobs", params={"status": "running"}, headers=api.headers()).json()
    assert queued["items"] == []


def test_pending_reason(api: Api) -> None:
    first = api.submit()
    assert api.get(first["id"])["pending_reason"] == f"no worker serves queue {api.queue}"
    register_worker(api, ["elsewhere"], name="w-other")
    register_worker(api, [api.queue], name="w-stale", age_s=60)  # dead: not counted
    api.services._workers = (0.0, [])  # drop the one-second cache
    assert api.get(first["id"])["pending_reason"] == f"no worker serves queue {api.queue}"
    register_worker(api, [api.queue], name="w-live")
    second = api.submit()
    api.services._workers = (0.0, [])
    assert api.get(first["id"])["pending_reason"] == f"position 1 in queue {api.queue}"
    assert api.get(second["id"])["pending_reason"] == f"position 2 in queue {api.queue}"

    workers = api.client.get("/v1/workers", headers=api.headers()).json()["items"]
    names = [w["name"] for w in workers]
    assert "w-live" in names and "w-other" in names and "w-stale" not in names
    live = next(w for w in workers if w["name"] == "w-live")
    assert live["queues"] == [api.queue] and live["gpus"] == [0, 1] and live["slots"] == 2


def test_workers_name_only_the_callers_running_jobs(api: Api) -> None:
    mine = api.submit()["id"]
    theirs = api.client.post(
        "/v1/jobs", json={"queue": api.queue, "train": {}}, headers=api.headers(api.other_token)
    ).json()["id"]
    name = f"w-busy-{api.queue}"
    register_worker(api, [api.queue], name=name, running=[mine, theirs])

    def seen(token: str) -> dict[str, Any]:
        items = api.client.get("/v1/workers", headers=api.headers(token)).json()["items"]
        return next(w for w in items if w["name"] == name)

    assert (seen(api.token)["running"], seen(api.token)["busy"]) == ([mine], 2)
    assert (seen(api.other_token)["running"], seen(api.other_token)["busy"]) == ([theirs], 2)
    assert sorted(seen(api.admin_token)["running"]) == sorted([mine, theirs])


def test_health_ready_and_prometheus(api: Api) -> None:
    assert api.client.get("/healthz").json() == {"status": "ok"}
    ready = api.client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["database"] == "ok"
    api.submit()
    register_worker(api, [api.queue], name=f"w-{api.queue}")
    for n in range(3):  # queues nobody serves: user strings, never labels of their own
        api.submit(queue=f"tenant-chosen-{api.queue}-{n}")
    assert api.client.get("/metrics").status_code == 401
    assert api.client.get("/metrics", headers=api.headers()).status_code == 403
    text = api.client.get("/metrics", headers=api.headers(api.admin_token)).text
    assert 'trainq_jobs{status="queued"}' in text
    assert f'trainq_queue_depth{{queue="{api.queue}"}} 1.0' in text
    assert "tenant-chosen" not in text
    other = [line for line in text.splitlines() if 'queue="_other"' in line]
    assert other and float(other[0].split()[-1]) >= 3
    assert "trainq_request_seconds_bucket" in text and 'route="/v1/jobs"' in text


def test_openapi_documents_every_route(api: Api) -> None:
    schema = api.client.get("/openapi.json").json()
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            assert op.get("summary") and op.get("description"), (method, path)
    body = schema["paths"]["/v1/jobs"]["post"]["requestBody"]["content"]
    assert set(body) == {"application/json", "application/yaml"}
    assert "TrainConfig" in schema["components"]["schemas"]


def test_api_docs_load_nothing_from_outside(api: Api) -> None:
    page = api.client.get("/docs")
    assert page.status_code == 200 and "SwaggerUIBundle" in page.text
    urls = re.findall(r"""(?:src|href)=["']([^"']+)["']""", page.text)
    urls += re.findall(r"""url: ?["']([^"']+)["']""", page.text)
    assert urls, page.text
    for url in urls:
        assert url.startswith("/"), f"{url} is not served by the API itself"
        assert api.client.get(url).status_code == 200, url
