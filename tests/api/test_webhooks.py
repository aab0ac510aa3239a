"""Webhooks and the events feed, against a real receiving HTTP server on loopback that
verifies every delivery with the ``standardwebhooks`` package.

Jobs are driven through the real wire (``WorkerSim`` events, the ingestor, the state
machine), and a real ``Deliverer`` sends. Retries use a short backoff here
(``webhook_retry_base_s`` 0.1 s, at most 0.5 s) and the receiver is "down for a minute"
for ``DOWN_S`` seconds: the same code path as a day's schedule, in test time.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import delete, insert, select
from standardwebhooks import Webhook, WebhookVerificationError

from service.api.app import create_app
from service.api.core.models import EVENTS, WEBHOOK_DELIVERIES, WEBHOOKS, utcnow
from service.api.core.settings import Settings
from service.api.scheduling.retention import Retention
from service.api.webhooks.delivery import Deliverer, Pace
from service.api.webhooks.sender import Connection, SendFailed
from tests.api.support import Api, WorkerSim, forget_jobs_since, free_port, make_tokens
from trainer.outbound import OutboundRefused, Unresolved, check_url, pinned_addresses

DOWN_S = 3.0  # how long the receiver is away ("a minute", shortened)


class Receiver:
    """An HTTP endpoint on loopback: verifies each delivery's signature with the secret it is
    given, answers ``answer`` (204 by default), and keeps what it received, in order."""

    def __init__(self) -> None:
        self.port = free_port()
        self.secret: str | None = None
        self.answer = 204
        self.received: list[dict[str, Any]] = []
        self.arrived: list[float] = []  # time.monotonic() of each in received
        self.bad: list[str] = []
        self.lock = threading.Lock()
        self.server: ThreadingHTTPServer | None = None
        self.conns: list[socket.socket] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def start(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                with receiver.lock:
                    receiver.conns.append(self.connection)

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                status = receiver.answer
                try:
                    assert receiver.secret is not None
                    payload = Webhook(receiver.secret).verify(body, dict(self.headers))
                    if status < 300:
                        with receiver.lock:
                            receiver.received.append({"id": self.headers["webhook-id"], **payload})
                            receiver.arrived.append(time.monotonic())
                except WebhookVerificationError as exc:
                    receiver.bad.append(str(exc))
                    status = 400
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *_: Any) -> None:
                pass

        ThreadingHTTPServer.allow_reuse_address = True
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
        with self.lock:  # the kept-alive connections too: down is down
            for conn in self.conns:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
            self.conns.clear()

    def unique(self) -> list[dict[str, Any]]:
        """What arrived, the first copy of each webhook-id (delivery is at least once)."""
        seen: set[str] = set()
        out = []
        with self.lock:
            for item in self.received:
                if item["id"] not in seen:
                    seen.add(item["id"])
                    out.append(item)
        return out


Hooks = Callable[..., tuple[Api, Deliverer]]


@pytest.fixture()
def hooks(make_settings: Callable[..., Settings]) -> Iterator[Hooks]:
    """Builds an app whose admin allows loopback targets, with short retries, and a
    deliverer running beside it (settings overridable; ``start=False``: none running)."""
    started_ms = int(time.time() * 1000)
    stack = contextlib.ExitStack()

    def build(start: bool = True, **overrides: Any) -> tuple[Api, Deliverer]:
        settings = make_settings(
            **{
                "webhook_allow_loopback": True,
                "webhook_retry_base_s": 0.1,
                "webhook_retry_max_s": 0.5,
                "webhook_poll_s": 0.05,
                "webhook_timeout_s": 2.0,
                **overrides,
            }
        )
        app = create_app(settings)
        services = app.state.services
        user, token, other, admin = make_tokens(services)
        deliverer = Deliverer(settings, services.sessions)
        client = stack.enter_context(TestClient(app))
        if start:
            stack.enter_context(_running(deliverer))
        return Api(app, client, services, user, token, other, admin), deliverer

    with stack:
        yield build
    forget_jobs_since(make_settings().database_url, started_ms)


@contextlib.contextmanager
def _running(deliverer: Deliverer) -> Iterator[None]:
    stop = threading.Event()
    thread = threading.Thread(target=deliverer.run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)


@pytest.fixture()
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    r.start()
    yield r
    r.stop()


def _create(api: Api, url: str, events: list[str], token: str | None = None) -> dict[str, Any]:
    resp = api.client.post(
        "/v1/webhooks", json={"url": url, "events": events}, headers=api.headers(token)
    )
    assert resp.status_code == 201, resp.text
    return dict(resp.json())


def _feed(api: Api, token: str | None = None, page: int = 7) -> list[dict[str, Any]]:
    """Every event of the token's owner, read page by page with the cursor."""
    out: list[dict[str, Any]] = []
    cursor = "0"
    while True:
        resp = api.client.get(
            "/v1/events", params={"after": cursor, "limit": page}, headers=api.headers(token)
        )
        assert resp.status_code == 200, resp.text
        body = resp.json()
        out.extend(body["items"])
        if not body["items"]:
            assert body["next_cursor"] == cursor
            return out
        cursor = body["next_cursor"]


def _wait(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_fifty_jobs_every_status_change_in_order_through_an_outage(
    hooks: Hooks, receiver: Receiver
) -> None:
    api, _ = hooks()
    hook = _create(api, receiver.url, ["job.*"])
    assert hook["secret"].startswith("whsec_") and hook["enabled"]
    receiver.secret = hook["secret"]
    listed = api.client.get("/v1/webhooks", headers=api.headers()).json()["items"]
    assert [h["id"] for h in listed] == [hook["id"]] and "secret" not in listed[0]
    # Another owner's job and endpoint: nothing of it may reach this receiver.
    theirs = api.client.post(
        "/v1/jobs",
        json={"name": "t", "queue": api.queue, "train": {"steps": 5}},
        headers=api.headers(api.other_token),
    ).json()

    jobs = [api.submit(retries=1 if i % 10 == 9 else 0)["id"] for i in range(50)]
    sims = {j: WorkerSim(api.services.redis, api.keys, j) for j in jobs}
    for sim in [*sims.values(), WorkerSim(api.services.redis, api.keys, theirs["id"])]:
        sim.running()
    api.drain()
    _wait(lambda: len(receiver.unique()) >= 50, 20, "the running events")

    receiver.stop()  # the endpoint goes away while the jobs end
    for n, (job_id, sim) in enumerate(sims.items()):
        if n % 10 == 9:  # failed once, retried: queued again, then runs and succeeds
            sim.exited(1, None, "boom")
        elif n % 10 == 8:
            sim.exited(1, None, "boom")  # no retries left: failed
        elif n % 10 == 7:
            assert api.client.post(f"/v1/jobs/{job_id}/cancel", headers=api.headers()).status_code
            sim.exited(None, "cancelled", "stopped")
        else:
            sim.exited(0)
    api.drain()
    for n, sim in enumerate(sims.values()):
        if n % 10 == 9:
            again = WorkerSim(api.services.redis, api.keys, sim.job_id, attempt=2)
            again.running()
            again.exited(0)
    api.drain()
    time.sleep(DOWN_S)
    receiver.start()

    feed = _feed(api)
    expected = {j: [e["type"] for e in feed if e["data"]["job_id"] == j] for j in jobs}
    assert expected[jobs[0]] == ["job.running", "job.succeeded"]
    assert expected[jobs[7]] == ["job.running", "job.cancelling", "job.cancelled"]
    assert expected[jobs[8]] == ["job.running", "job.failed"]
    assert expected[jobs[9]] == ["job.running", "job.queued", "job.running", "job.succeeded"]
    total = sum(len(v) for v in expected.values())
    _wait(lambda: len(receiver.unique()) >= total, 30, "every event after the outage")

    got = receiver.unique()
    assert receiver.bad == []  # every delivery verified with standardwebhooks
    assert len(got) == total and {g["id"] for g in got} == {f"msg_{e['id']}" for e in feed}
    for job_id in jobs:  # exactly the feed's events of each job, in the feed's order
        assert [g["type"] for g in got if g["data"]["job_id"] == job_id] == expected[job_id]
    assert all(set(g) == {"id", "type", "timestamp", "data"} for g in got)
    assert theirs["id"] not in {g["data"]["job_id"] for g in got}
    assert theirs["id"] not in {e["data"]["job_id"] for e in feed}
    assert {e["data"]["job_id"] for e in _feed(api, api.other_token)} == {theirs["id"]}

    def log() -> list[dict[str, Any]]:
        return list(
            api.client.get(
                f"/v1/webhooks/{hook['id']}/deliveries",
                params={"limit": 500},
                headers=api.headers(),
            ).json()["items"]
        )

    # outcomes are stored a batch at a time, a moment after the endpoint answered
    _wait(lambda: all(d["status"] == "delivered" for d in log()), 10, "the outcomes stored")
    assert len(log()) == total
    assert max(d["attempts"] for d in log()) > 1  # the outage was retried through
    gone = api.client.get(f"/v1/webhooks/{hook['id']}", headers=api.headers(api.other_token))
    assert gone.status_code == 404


def test_failing_endpoint_is_disabled_then_reenabled_and_redelivered(
    hooks: Hooks, receiver: Receiver
) -> None:
    api, _ = hooks(webhook_disable_failures=4, webhook_disable_after_s=0.5)
    receiver.answer = 500
    hook = _create(api, receiver.url, ["job.running"])
    receiver.secret = hook["secret"]
    job_id = api.submit()["id"]
    WorkerSim(api.services.redis, api.keys, job_id).running()
    api.drain()
    url = f"/v1/webhooks/{hook['id']}"

    def disabled() -> bool:
        return not api.client.get(url, headers=api.headers()).json()["enabled"]

    _wait(disabled, 20, "the endpoint to be disabled")
    shown = api.client.get(url, headers=api.headers()).json()
    assert "failed deliveries in a row" in shown["disabled_reason"]
    assert "HTTP 500" in shown["disabled_reason"]
    (pending,) = api.client.get(f"{url}/deliveries", headers=api.headers()).json()["items"]
    assert pending["status"] == "pending" and pending["attempts"] >= 4
    assert pending["last_status"] == 500 and pending["type"] == "job.running"
    assert receiver.received == []

    receiver.answer = 204
    resp = api.client.patch(url, json={"enabled": True}, headers=api.headers())
    assert resp.status_code == 200 and resp.json()["disabled_reason"] is None
    _wait(lambda: len(receiver.received) == 1, 20, "the pending delivery after re-enabling")
    assert receiver.received[0]["data"]["job_id"] == job_id

    def delivered() -> bool:  # the receiver has it before the deliverer records the 2xx
        items = api.client.get(f"{url}/deliveries", headers=api.headers()).json()["items"]
        return bool(items[0]["status"] == "delivered")

    _wait(delivered, 20, "the delivery recorded as delivered")
    again = api.client.post(f"{url}/deliveries/{pending['id']}/redeliver", headers=api.headers())
    assert again.status_code == 202 and again.json()["status"] == "pending"
    _wait(lambda: len(receiver.received) == 2, 20, "the redelivery")
    assert receiver.received[1]["id"] == receiver.received[0]["id"]  # the same webhook-id
    missing = api.client.post(f"{url}/deliveries/999999999/redeliver", headers=api.headers())
    assert missing.status_code == 404
    assert api.client.delete(url, headers=api.headers()).status_code == 204
    assert api.client.get(url, headers=api.headers()).status_code == 404


REFUSED = [
    "http://127.0.0.1:8080/hook",
    "http://localhost/hook",
    "http://10.1.2.3/hook",
    "http://192.168.0.1/hook",
    "http://169.254.169.254/latest/meta-data/",
    "http://[fd00:ec2::254]/",
    "http://[::1]/",
    "http://[::ffff:127.0.0.1]/",
    "http://[::ffff:169.254.169.254]/",
    "http://2130706433/",  # 127.0.0.1 as one number
    "http://0x7f.1/",
    "http://[fe80::1%25eth0]/",
    "http://224.0.0.1/",
    "http://0.0.0.0/",
    "ftp://example.com/hook",
    "http:///nohost",
    "http://user:pw@example.com/",
    "https://b\u00fccher.example/hook",  # IDNA: accepted, then never sent (the sender's Host)
    "https://example.com/h\u00e9",
]


def test_a_deliverer_paced_by_its_setting_drains_a_backlog_at_that_pace(
    hooks: Hooks, receiver: Receiver
) -> None:
    """``TRAINQ_WEBHOOK_MAX_PER_S``: a backlog goes out at that many a second (after a
    quarter second's burst), every delivery still arriving, in order per job."""
    rate, n = 20.0, 30
    api, deliverer = hooks(webhook_max_per_s=rate)
    hook = _create(api, receiver.url, ["job.running"])
    receiver.secret = hook["secret"]
    jobs = [api.submit()["id"] for _ in range(n)]
    for job_id in jobs:
        WorkerSim(api.services.redis, api.keys, job_id).running()
    api.drain()
    _wait(lambda: len(receiver.unique()) == n, 30, "every delivery")
    got = receiver.unique()
    assert sorted(g["data"]["job_id"] for g in got) == sorted(jobs) and receiver.bad == []
    burst = int(rate * Pace.BURST_S)
    spread = receiver.arrived[-1] - receiver.arrived[0]
    assert spread >= (n - burst - 1) / rate, f"{n} deliveries in {spread:.2f} s: not paced"
    assert deliverer.pace.per_s == rate


def test_private_loopback_and_metadata_targets_are_refused_naming_url(api: Api) -> None:
    assert not api.settings.webhook_allow_loopback
    for url in REFUSED:
        resp = api.client.post(
            "/v1/webhooks", json={"url": url, "events": ["job.*"]}, headers=api.headers()
        )
        assert resp.status_code == 422, (url, resp.text)
        assert resp.json()["detail"][0]["loc"] == ["body", "url"], url
    bad = api.client.post(
        "/v1/webhooks",
        json={"url": "https://example.com/h", "events": ["job.nope"]},
        headers=api.headers(),
    )
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"][:2] == ["body", "events"]
    ok = api.client.post(
        "/v1/webhooks",
        json={"url": "https://hooks.example.com/h", "events": ["job.*", "checkpoint.*"]},
        headers=api.headers(),
    )
    assert ok.status_code == 201  # a name is checked where it is resolved, at delivery
    assert api.client.get("/v1/events", params={"after": "x"}, headers=api.headers()).json()[
        "detail"
    ][0]["loc"] == ["query", "after"]


def test_a_name_resolving_to_a_private_address_is_a_422_at_create_and_patch(api: Api) -> None:
    host = socket.gethostname()  # a name (not "localhost") that resolves to this host
    try:
        pinned_addresses(host, 80)
    except Unresolved:
        pytest.skip(f"{host} does not resolve here")
    except OutboundRefused:
        pass  # loopback or private, as a host's own name is on most machines
    else:
        pytest.skip(f"{host} resolves to a public address here")
    url = f"http://{host}:8080/hook"
    refused = api.client.post(
        "/v1/webhooks", json={"url": url, "events": ["job.*"]}, headers=api.headers()
    )
    assert refused.status_code == 422, refused.text
    detail = refused.json()["detail"][0]
    assert detail["loc"] == ["body", "url"] and "resolves to a refused address" in detail["msg"]
    hook = _create(api, "https://hooks.example.com/h", ["job.*"])  # no answer yet: taken
    patched = api.client.patch(
        f"/v1/webhooks/{hook['id']}", json={"url": url}, headers=api.headers()
    )
    assert patched.status_code == 422 and patched.json()["detail"][0]["loc"] == ["body", "url"]
    assert api.client.get(f"/v1/webhooks/{hook['id']}", headers=api.headers()).json()["url"] == (
        "https://hooks.example.com/h"
    )


def test_outbound_policy_even_when_private_targets_are_allowed() -> None:
    for url in (
        "http://169.254.169.254/",
        "http://[fd00:ec2::254]/",
        "http://[::ffff:a9fe:a9fe]/",
        "http://[fe80::1]/",
    ):
        with pytest.raises(OutboundRefused):
            check_url(url, allow_private=True)
    assert check_url("http://127.0.0.1:9/x", allow_private=True).port == 9
    with pytest.raises(OutboundRefused, match="loopback"):
        pinned_addresses("localhost", 80)  # resolved: every address checked
    assert "127.0.0.1" in pinned_addresses("localhost", 80, allow_private=True)
    with pytest.raises(OutboundRefused, match="does not resolve"):
        pinned_addresses(f"{uuid.uuid4().hex}.invalid", 80)
    # The request is written by hand (one send): a path that is not ASCII is refused, not sent
    odd = Connection(
        "http://127.0.0.1:9/h\u00e9", timeout_s=1, max_response_bytes=1, allow_private=True
    )
    with pytest.raises(SendFailed, match="not ASCII"):
        odd.post(b"{}", {})


def test_events_are_owned_and_paged(api: Api) -> None:
    job = api.submit()
    sim = WorkerSim(api.services.redis, api.keys, job["id"])
    sim.running()
    sim.exited(0)
    api.drain()
    feed = _feed(api, page=1)
    assert [e["type"] for e in feed] == ["job.running", "job.succeeded"]
    assert int(feed[0]["id"]) < int(feed[1]["id"])
    assert feed[1]["data"] == {
        "job_id": job["id"], "attempt": 1, "status": "succeeded", "reason": None,
        "message": None,
    }  # fmt: skip
    assert _feed(api, api.other_token) == []
    assert json.loads(json.dumps(feed)) == feed


def test_checkpoint_written_once_however_often_replayed(api: Api) -> None:
    job = api.submit()
    sim = WorkerSim(api.services.redis, api.keys, job["id"])
    sim.running()
    written = sim.event("checkpoint", "trainer", {"step": 5, "checkpoint": "step-5"})
    sim.send(written)  # the same event again, as a replayed stream delivers it
    sim.event("checkpoint", "trainer", {"step": 6, "checkpoint": "../../etc"})  # ignored
    api.drain()
    feed = _feed(api)
    assert [e["type"] for e in feed] == ["job.running", "checkpoint.written"]
    assert feed[1]["data"] == {
        "job_id": job["id"], "attempt": 1, "step": 5, "checkpoint": "step-5",
    }  # fmt: skip


def test_retention_prunes_old_events_but_not_what_a_delivery_or_fan_out_needs(api: Api) -> None:
    owner, bystander = f"prune-{uuid.uuid4().hex[:8]}", f"prune-{uuid.uuid4().hex[:8]}"
    now = utcnow()
    old, recent = now - timedelta(days=40), now - timedelta(days=1)
    endpoint = uuid.uuid4().hex
    with api.services.sessions() as session, session.begin():

        def event(who: str, when: Any) -> int:
            row: dict[str, Any] = {"owner": who, "type": "job.running", "job_id": None, "data": {}}
            stmt = insert(EVENTS).values(**row, created_at=when).returning(EVENTS.c.id)
            return int(session.execute(stmt).scalar_one())

        delivered, pending, fanned, unread = (event(owner, old) for _ in range(4))
        new = event(owner, recent)
        stranger = event(bystander, old)  # an owner with no endpoint: nothing holds it
        session.execute(
            insert(WEBHOOKS).values(
                id=endpoint, owner=owner, url="https://hooks.example.com/h", events=["job.*"],
                secret="whsec_" + "A" * 32, enabled=True, after_event=fanned, failures=0,
                created_at=old, updated_at=old,
            )
        )  # fmt: skip

        def delivery(event_id: int, status: str, when: Any) -> None:
            session.execute(
                insert(WEBHOOK_DELIVERIES).values(
                    endpoint_id=endpoint, event_id=event_id, job_id=None, status=status,
                    attempts=1, next_attempt_at=when, give_up_at=now, created_at=when,
                    updated_at=when,
                )
            )  # fmt: skip

        delivery(delivered, "delivered", old)
        delivery(pending, "pending", old)  # still retried: its event must stay
        delivery(fanned, "failed", recent)  # ended lately, but its event is past retention

    def left() -> tuple[set[int], set[tuple[int, str]]]:
        with api.services.sessions() as session:
            events = set(
                session.execute(
                    select(EVENTS.c.id).where(EVENTS.c.owner.in_([owner, bystander]))
                ).scalars()
            )
            deliveries = {
                (r.event_id, r.status)
                for r in session.execute(
                    select(WEBHOOK_DELIVERIES).where(WEBHOOK_DELIVERIES.c.endpoint_id == endpoint)
                )
            }
        return events, deliveries

    everything = left()
    off = api.settings.model_copy(update={"retention_days": 0, "events_retention_days": 0})
    assert Retention(off, api.services.sessions, api.services.redis).run_once() == 0
    assert left() == everything  # 0 days: kept forever

    on = api.settings.model_copy(update={"retention_days": 0, "events_retention_days": 30})
    Retention(on, api.services.sessions, api.services.redis).run_once()
    events, deliveries = left()
    # pending: an unfinished delivery needs it; unread: after the endpoint's cursor; new: young
    assert events == {pending, unread, new}
    assert delivered not in events and fanned not in events and stranger not in events
    assert deliveries == {(pending, "pending")}
    with api.services.sessions() as session, session.begin():  # no endpoint left behind
        session.execute(delete(WEBHOOKS).where(WEBHOOKS.c.id == endpoint))


def _statuses(api: Api, hook_id: str) -> list[str]:
    with api.services.sessions() as session:
        rows = session.execute(
            select(WEBHOOK_DELIVERIES.c.status)
            .where(WEBHOOK_DELIVERIES.c.endpoint_id == hook_id)
            .order_by(WEBHOOK_DELIVERIES.c.event_id)
        )
        return list(rows.scalars())


def test_a_killed_deliverers_deliveries_are_taken_over_after_its_lease(
    hooks: Hooks, receiver: Receiver
) -> None:
    """A deliverer process holds its claims while it lives (its lease renewed, however long
    its send takes), and another deliverer takes them over within a lease once it is
    killed."""
    lease = 1.0  # the least the setting allows; a minute by default
    api, survivor = hooks(start=False, webhook_lease_s=lease, webhook_timeout_s=30.0)
    silent = socket.create_server(("127.0.0.1", 0))  # takes connections, never answers
    hook = _create(api, f"http://127.0.0.1:{silent.getsockname()[1]}/hook", ["job.*"])
    receiver.secret = hook["secret"]
    job = api.submit()["id"]
    sim = WorkerSim(api.services.redis, api.keys, job)
    sim.running()
    sim.exited(0)
    api.drain()
    s = api.settings
    env = {
        **os.environ,
        "TRAINQ_DATABASE_URL": s.database_url, "TRAINQ_REDIS_URL": s.redis_url,
        "TRAINQ_BROKER_URL": s.broker_url, "TRAINQ_REDIS_PREFIX": s.redis_prefix,
        "TRAINQ_DATA_ROOT": str(s.data_root), "TRAINQ_RUNS_ROOT": str(s.runs_root),
        "TRAINQ_WEBHOOK_ALLOW_LOOPBACK": "1", "TRAINQ_WEBHOOK_LEASE_S": str(lease),
        "TRAINQ_WEBHOOK_POLL_S": "0.05", "TRAINQ_WEBHOOK_TIMEOUT_S": "30",
    }  # fmt: skip
    doomed = subprocess.Popen(
        [sys.executable, "-m", "service.api.webhooks.delivery"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        # the first event is sent (and hangs), the second waits behind it (in order per job)
        _wait(lambda: _statuses(api, hook["id"]) == ["sending", "waiting"], 30, "the claim")
        api.client.patch(
            f"/v1/webhooks/{hook['id']}", json={"url": receiver.url}, headers=api.headers()
        )
        with _running(survivor):
            time.sleep(3 * lease)  # three leases: renewed by the living deliverer each third
            assert _statuses(api, hook["id"]) == ["sending", "waiting"]
            assert receiver.unique() == []
            os.killpg(doomed.pid, signal.SIGKILL)
            doomed.wait(10)
            _wait(lambda: len(receiver.unique()) == 2, 10 * lease, "the takeover")
    finally:
        if doomed.poll() is None:
            os.killpg(doomed.pid, signal.SIGKILL)
            doomed.wait(10)
        silent.close()
    assert [g["type"] for g in receiver.unique()] == ["job.running", "job.succeeded"]
    assert receiver.bad == []
