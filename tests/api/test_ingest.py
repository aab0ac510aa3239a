"""The ingestor applies what a worker and a trainer stream back; replays and crashes are safe."""

from __future__ import annotations

import csv
import io
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import func, select

from service.api.core.models import LOGS, METRICS
from service.api.streams.ingest import Ingestor
from tests.api.support import Api, WorkerSim
from trainer.events import Event, Keys, Publisher


def _counts(api: Api, job_id: str) -> tuple[int, int]:
    with api.services.sessions() as session:
        metrics = session.execute(
            select(func.count()).select_from(METRICS).where(METRICS.c.job_id == job_id)
        ).scalar_one()
        logs = session.execute(
            select(func.count()).select_from(LOGS).where(LOGS.c.job_id == job_id)
        ).scalar_one()
    return int(metrics), int(logs)


def _ingestor(
    api: Api, make_settings: Callable[..., Any], consumer: str, **overrides: Any
) -> Ingestor:
    """An ingestor of ``api``'s streams with settings of its own, as another replica."""
    settings = make_settings(redis_prefix=api.settings.redis_prefix, **overrides)
    s = api.services
    return Ingestor(settings, s.sessions, s.redis, s.dispatcher, consumer=consumer)


def _job_stream_statuses(api: Api, job_id: str) -> list[str]:
    entries = api.services.redis.xrange(api.keys.job(job_id))
    return [
        f[b"data"].decode().split('"status":"')[1].split('"')[0]
        for _, f in entries
        if f[b"kind"] == b"status"
    ]


def test_full_lifecycle_through_the_real_publisher(api: Api) -> None:
    job = api.submit()
    url, prefix = api.settings.redis_url, api.settings.redis_prefix
    worker = Publisher(url, job["id"], 1, "worker", prefix=prefix)
    trainer = Publisher(url, job["id"], 1, "trainer", prefix=prefix)
    try:
        worker.emit("lifecycle", {"phase": "running", "host": "gpu-7", "worker": "w7", "pid": 99})
        for step in range(1, 6):
            trainer.emit(
                "metric",
                {
                    "step": step,
                    "steps": 5,
                    "loss": 3.0 - step / 10,
                    "tokens_per_s": 1e4,
                    "mfu": None,
                    "val_loss": 2.5 if step == 4 else None,
                },
            )
        worker.emit(
            "log", {"lines": [{"rank": 0, "stream": "stdout", "line": f"step {i}"} for i in (1, 2)]}
        )
        assert worker.flush(5) and trainer.flush(5)
        ingestor = api.ingestor()
        api.drain(ingestor)
        running = api.get(job["id"])
        assert running["status"] == "running" and running["started_at"] is not None
        assert running["attempts"][0]["host"] == "gpu-7"
        assert running["latest"]["step"] == 5 and running["latest"]["loss"] == pytest.approx(2.5)
        assert running["latest"]["val_loss"] == pytest.approx(2.5)  # carried from step 4

        worker.emit("lifecycle", {"phase": "exited", "exit_code": 0, "reason": None, "message": ""})
        assert worker.flush(5)
        api.drain(ingestor)
    finally:
        worker.close(2)
        trainer.close(2)
    done = api.get(job["id"])
    assert done["status"] == "succeeded" and done["ended_at"] is not None
    assert done["attempts"][0]["status"] == "exited" and done["attempts"][0]["exit_code"] == 0
    assert _counts(api, job["id"]) == (5, 1)
    assert _job_stream_statuses(api, job["id"]) == ["running", "succeeded"]
    # Everything read was acked after the commit.
    assert api.services.redis.xpending(api.keys.events, api.settings.consumer_group)["pending"] == 0

    metrics = api.client.get(f"/v1/jobs/{job['id']}/metrics", headers=api.headers()).json()
    assert [p["step"] for p in metrics["points"]] == [1, 2, 3, 4, 5]
    assert metrics["points"][3]["val_loss"] == pytest.approx(2.5)
    logs = api.client.get(f"/v1/jobs/{job['id']}/logs", headers=api.headers())
    assert logs.text == "[a1 rank 0] step 1\n[a1 rank 0] step 2\n"


def test_replay_changes_nothing(api: Api, sim: Callable[..., WorkerSim]) -> None:
    job = api.submit()
    w = sim(job["id"])
    events = [w.running(), w.metric(1), w.metric(2), w.log((0, "a"), (1, "b")), w.exited(0)]
    api.drain()
    before = api.get(job["id"])
    counts = _counts(api, job["id"])
    statuses = _job_stream_statuses(api, job["id"])
    for ev in events:  # the same events again, as a worker redelivering would send them
        w.send(ev)
    # ... and a late "running" of the attempt that already ended.
    w.running()
    api.drain()
    after = api.get(job["id"])
    assert after == before
    assert _counts(api, job["id"]) == counts == (2, 1)
    assert _job_stream_statuses(api, job["id"]) == statuses == ["running", "succeeded"]


def test_crash_before_ack_loses_nothing(api: Api, sim: Callable[..., WorkerSim]) -> None:
    job = api.submit()
    w = sim(job["id"])
    w.running()
    w.metric(1)
    keys: Keys = api.keys
    r = api.services.redis
    first = api.ingestor(consumer="replica-a")
    first.ensure_group()
    # replica-a reads the batch and dies before committing: the entries stay pending.
    got = r.xreadgroup(api.settings.consumer_group, "replica-a", {keys.events: ">"}, count=100)
    assert len(got[0][1]) == 2
    assert api.get(job["id"])["status"] == "queued"

    # Restarted under the same name, it reads its own pending entries first.
    api.drain(api.ingestor(consumer="replica-a"))
    assert api.get(job["id"])["status"] == "running"
    assert _counts(api, job["id"]) == (1, 0)
    assert r.xpending(keys.events, api.settings.consumer_group)["pending"] == 0


def test_a_dead_consumers_pending_entries_are_claimed(
    api: Api, sim: Callable[..., WorkerSim], make_settings: Callable[..., Any]
) -> None:
    job = api.submit()
    w = sim(job["id"])
    w.running()
    r = api.services.redis
    api.ingestor(consumer="dead").ensure_group()
    r.xreadgroup(api.settings.consumer_group, "dead", {api.keys.events: ">"}, count=100)
    other = _ingestor(api, make_settings, "alive", ingest_claim_idle_ms=0)
    api.drain(other)
    assert api.get(job["id"])["status"] == "running"
    assert r.xpending(api.keys.events, api.settings.consumer_group)["pending"] == 0


def test_malformed_events_are_dropped_not_fatal(api: Api, sim: Callable[..., WorkerSim]) -> None:
    job = api.submit()
    r = api.services.redis
    r.xadd(api.keys.events, {"kind": "metric", "job": job["id"]})  # missing fields
    r.xadd(
        api.keys.events,
        {
            "v": "1",
            "kind": "nope",
            "job": "x",
            "attempt": "1",
            "src": "w",
            "seq": "1",
            "ts": "1",
            "data": "{}",
        },
    )
    w = sim(job["id"])
    w.metric(1, loss=float("nan") if False else None)
    w.event("metric", "trainer", {"step": "not a number"})
    w.event("log", "worker", {"lines": "not a list"})
    w.event(
        "lifecycle",
        "worker",
        {"phase": "exited", "exit_code": 1, "reason": "bogus", "message": "x"},
    )
    api.drain()
    got = api.get(job["id"])
    assert got["status"] == "failed" and got["reason"] == "exit_code"
    assert "unknown reason" in got["message"]
    assert _counts(api, job["id"]) == (1, 0)
    assert r.xpending(api.keys.events, api.settings.consumer_group)["pending"] == 0


def test_metrics_downsampling_csv_and_resume(api: Api, sim: Callable[..., WorkerSim]) -> None:
    job = api.submit(retries=1)
    w1 = sim(job["id"], 1)
    w1.claim()
    w1.running()
    for step in range(1, 101):
        w1.metric(step, steps=200)
    w1.exited(1, "exit_code", "rank 1 died")
    api.drain()
    assert api.get(job["id"])["attempt"] == 2
    w2 = sim(job["id"], 2)
    w2.running()
    for step in range(91, 201):  # resumed from the checkpoint at step 90
        w2.metric(step, steps=200, loss=1.0)
    api.drain()
    url = f"/v1/jobs/{job['id']}/metrics"
    full = api.client.get(url, params={"max_points": 1000}, headers=api.headers()).json()
    assert full["total"] == 200 and not full["downsampled"]
    by_step = {p["step"]: p for p in full["points"]}
    assert by_step[95]["attempt"] == 2 and by_step[95]["loss"] == 1.0  # resumed point wins
    assert by_step[50]["attempt"] == 1

    small = api.client.get(url, params={"max_points": 10}, headers=api.headers()).json()
    steps = [p["step"] for p in small["points"]]
    assert small["downsampled"] and len(steps) == 10 and steps[0] == 1 and steps[-1] == 200
    since = api.client.get(url, params={"since_step": 190}, headers=api.headers()).json()
    assert [p["step"] for p in since["points"]] == list(range(190, 201))

    text = api.client.get(url, params={"format": "csv", "since_step": 199}, headers=api.headers())
    assert text.headers["content-type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(text.text)))
    assert [r["step"] for r in rows] == ["199", "200"] and rows[0]["loss"] == "1.0"
    assert rows[0]["mfu"] == ""  # null stays empty
    assert api.get(job["id"])["latest"]["step"] == 200


def test_logs_tail_rank_filter_and_caps(api: Api, sim: Callable[..., WorkerSim]) -> None:
    job = api.submit()
    w = sim(job["id"])
    w.running()
    w.log((0, "r0 a"), (1, "r1 a"))
    w.log((0, "r0 b"), (None, "worker says"), (1, "x" * 10_000))
    api.drain()
    url = f"/v1/jobs/{job['id']}/logs"
    all_lines = api.client.get(url, headers=api.headers()).text.splitlines()
    assert all_lines[:4] == [
        "[a1 rank 0] r0 a",
        "[a1 rank 1] r1 a",
        "[a1 rank 0] r0 b",
        "[a1 worker] worker says",
    ]
    assert len(all_lines[4]) < 8300 and all_lines[4].endswith("…")  # capped line
    assert api.client.get(url, params={"tail": 2}, headers=api.headers()).text.splitlines()[0] == (
        "[a1 worker] worker says"
    )
    rank0 = api.client.get(url, params={"rank": 0}, headers=api.headers()).text.splitlines()
    assert rank0 == ["[a1 rank 0] r0 a", "[a1 rank 0] r0 b"]


def test_events_a_lost_attempt_sends_after_it_was_called_lost_are_dropped(
    api: Api, sim: Callable[..., WorkerSim]
) -> None:
    """A host cut off but alive comes back and sends what its ranks did meanwhile: the
    service had called that attempt lost and started the next, so it is not stored."""
    job = api.submit(retries=1)
    old = sim(job["id"], 1)
    old.claim()
    old.running()
    old.metric(1)
    api.drain()
    old.stop_heartbeat()  # the link went down
    assert api.reconciler().run_once() == {"sent": 0, "lost": 1}
    assert api.get(job["id"])["attempt"] == 2
    # What it buffered before the loss still lands; what it did after does not.
    old.send(Event("metric", job["id"], 1, "trainer", 90, {"step": 2, "loss": 1.0}, ts=0.0))
    ingestor = api.ingestor()
    old.metric(3)
    old.log((0, "still training after the cut"))
    api.drain(ingestor)
    assert ingestor.dropped == 2
    points = api.client.get(f"/v1/jobs/{job['id']}/metrics", headers=api.headers()).json()
    assert [(p["attempt"], p["step"]) for p in points["points"]] == [(1, 1), (1, 2)]
    logs = api.client.get(f"/v1/jobs/{job['id']}/logs", headers=api.headers())
    assert "still training" not in logs.text


def test_metrics_and_logs_wait_for_company_a_lifecycle_change_does_not(
    api: Api, sim: Callable[..., WorkerSim], make_settings: Callable[..., Any]
) -> None:
    """In its loop the ingestor holds metric and log entries up to ``ingest_linger_ms`` so
    several share one transaction; the first lifecycle entry ends that wait."""
    job = api.submit()
    w = sim(job["id"])
    w.running()
    api.drain()
    ing = _ingestor(api, make_settings, "lingering", ingest_linger_ms=10_000)
    ing.ensure_group()
    r, group = api.services.redis, api.settings.consumer_group
    handled: list[int] = []
    w.metric(1)
    loop = threading.Thread(target=lambda: handled.append(ing.run_once(block_ms=1000)))
    loop.start()
    try:
        w.log((0, "step 1"))
        w.metric(2)
        for _ in range(200):  # bounded: until the lingering read holds all three
            if r.xpending(api.keys.events, group)["pending"] == 3:
                break
            time.sleep(0.02)
        assert r.xpending(api.keys.events, group)["pending"] == 3
        assert loop.is_alive() and _counts(api, job["id"]) == (0, 0)  # held, not applied
        w.exited(0)
        loop.join(8)  # the linger is 10 s: only the lifecycle entry can end it this soon
        assert not loop.is_alive()
    finally:
        if loop.is_alive():
            w.exited(0)
            loop.join(20)
    assert handled == [4]  # one transaction for all four
    assert _counts(api, job["id"]) == (2, 1)
    assert api.get(job["id"])["status"] == "succeeded"
    assert r.xpending(api.keys.events, group)["pending"] == 0


def test_a_read_that_may_not_block_does_not_linger(
    api: Api, sim: Callable[..., WorkerSim], make_settings: Callable[..., Any]
) -> None:
    job = api.submit()
    w = sim(job["id"])
    w.running()
    api.drain()
    ing = _ingestor(api, make_settings, "draining", ingest_linger_ms=10_000)
    w.metric(1)  # alone: nothing but the missing block may end a linger
    t0 = time.monotonic()
    assert ing.run_once(block_ms=None) == 1
    assert time.monotonic() - t0 < 5  # did not wait out the 10 s linger
    assert _counts(api, job["id"]) == (1, 0)


def test_waits_longer_than_the_redis_socket_timeout_end_in_no_entries_not_an_error(
    api: Api, sim: Callable[..., WorkerSim], make_settings: Callable[..., Any]
) -> None:
    """A block or a linger longer than the client's socket timeout is read as several
    shorter waits: it ends with what came, never in redis' TimeoutError."""
    job = api.submit()
    w = sim(job["id"])
    w.running()
    api.drain()
    wait_ms = int(api.settings.redis_timeout_s * 2500)  # the socket's timeout, 2.5 times
    ing = _ingestor(api, make_settings, "patient", ingest_linger_ms=wait_ms)
    assert ing.run_once(block_ms=wait_ms) == 0  # nothing came
    w.metric(1)
    assert ing.run_once(block_ms=wait_ms) == 1  # lingered for company, none came
    assert _counts(api, job["id"]) == (1, 0)
