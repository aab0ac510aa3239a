"""Following a job over a real HTTP server: SSE (ids, resume, pings, close) and log follow."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import httpx

from service.api.app import create_app
from tests.api.support import Api, Uvicorn, WorkerSim, make_tokens
from trainer.events import Event


def _parse(lines: list[str]) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    cur: dict[str, Any] = {}
    comments = 0
    for line in lines:
        if line == "":
            if cur:
                events.append(cur)
            cur = {}
        elif line.startswith(":"):
            comments += 1
            events.append({"comment": line})
        else:
            key, _, value = line.partition(": ")
            cur[key] = value
    if cur:
        events.append(cur)
    return events


def _read_sse(url: str, headers: dict[str, str], out: list[str], done: threading.Event) -> None:
    with httpx.Client(timeout=20) as client, client.stream("GET", url, headers=headers) as resp:
        out.append(f"STATUS {resp.status_code} {resp.headers.get('content-type')}")
        for line in resp.iter_lines():
            out.append(line)
    done.set()


def test_sse_follows_resumes_and_closes(
    api: Api, sim: Callable[..., WorkerSim], make_settings: Callable[..., Any]
) -> None:
    app = create_app(
        make_settings(redis_prefix=api.settings.redis_prefix, ingest=True, ingest_block_ms=100)
    )
    make_tokens(app.state.services)
    job = api.submit()
    w = sim(job["id"])
    with Uvicorn(app) as server:
        url = f"{server.url}/v1/jobs/{job['id']}/events"
        lines: list[str] = []
        done = threading.Event()
        reader = threading.Thread(target=_read_sse, args=(url, api.headers(), lines, done))
        reader.start()
        w.running()
        w.metric(1)
        w.log((0, "hello"))
        # A quiet interval passes: a keep-alive ping, and the stream stays open.
        assert not done.wait(1.2)
        w.exited(0)  # the service's ingestor turns this into the final status event
        assert done.wait(15), lines
        reader.join(5)

        assert lines[0] == "STATUS 200 text/event-stream; charset=utf-8"
        events = _parse(lines[1:])
        assert any("comment" in e for e in events)  # ": ping"
        real = [e for e in events if "event" in e]
        kinds = [e["event"] for e in real]
        assert kinds[:3] == ["lifecycle", "metric", "log"]
        assert kinds[-1] == "status" and json.loads(real[-1]["data"])["status"] == "succeeded"
        assert json.loads(real[1]["data"])["step"] == 1
        assert all(e["id"].count("-") == 1 for e in real)  # Redis entry ids

        # Resuming after the metric gives exactly what came after it.
        resumed: list[str] = []
        _read_sse(
            url, {**api.headers(), "Last-Event-ID": real[1]["id"]}, resumed, threading.Event()
        )
        again = [e for e in _parse(resumed[1:]) if "event" in e]
        assert [e["id"] for e in again] == [e["id"] for e in real[2:]]


def test_sse_of_a_finished_job_with_no_stream_ends(
    api: Api, make_settings: Callable[..., Any]
) -> None:
    job = api.submit()
    api.client.post(f"/v1/jobs/{job['id']}/cancel", headers=api.headers())
    api.services.redis.delete(api.keys.job(job["id"]))  # trimmed, or the XADD was lost
    with Uvicorn(create_app(make_settings(redis_prefix=api.settings.redis_prefix))) as server:
        lines: list[str] = []
        _read_sse(
            f"{server.url}/v1/jobs/{job['id']}/events", api.headers(), lines, threading.Event()
        )
    status = [e for e in _parse(lines[1:]) if e.get("event") == "status"]
    assert len(status) == 1 and json.loads(status[0]["data"])["status"] == "cancelled"
    assert "id" not in status[0]  # from the row, so it has no stream id


def test_logs_follow_streams_until_the_end(
    api: Api, sim: Callable[..., WorkerSim], make_settings: Callable[..., Any]
) -> None:
    job = api.submit()
    w = sim(job["id"])
    w.running()
    w.log((0, "before"))
    api.drain()  # "before" is in SQL; the follower must not print it twice
    app = create_app(
        make_settings(redis_prefix=api.settings.redis_prefix, ingest=True, ingest_block_ms=100)
    )
    with Uvicorn(app) as server:
        got: list[str] = []
        done = threading.Event()

        def follow() -> None:
            with (
                httpx.Client(timeout=20) as client,
                client.stream(
                    "GET",
                    f"{server.url}/v1/jobs/{job['id']}/logs",
                    params={"follow": "true"},
                    headers=api.headers(),
                ) as resp,
            ):
                for line in resp.iter_lines():
                    got.append(line)
            done.set()

        t = threading.Thread(target=follow)
        t.start()
        w.log((1, "during"), (0, "more"))
        w.exited(0)
        assert done.wait(15), got
        t.join(5)
    assert got == ["[a1 rank 0] before", "[a1 rank 1] during", "[a1 rank 0] more"]


async def _follow_many(
    url: str,
    headers: dict[str, str],
    n: int,
    publish: Callable[[], None],
    late: Callable[[], dict[str, str]],
) -> tuple[list[int], list[list[str]], list[str]]:
    """``n`` followers at once; once all have their headers, ``publish`` runs (in a thread)
    and a late follower joins with the Last-Event-ID ``late`` gives. Events ids each saw."""
    import asyncio

    limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:
        ready = asyncio.Semaphore(0)
        statuses: list[int] = []

        async def one(extra: dict[str, str], signal: bool) -> list[str]:
            ids: list[str] = []
            async with client.stream("GET", url, headers={**headers, **extra}) as resp:
                statuses.append(resp.status_code)
                if signal:
                    ready.release()
                async for line in resp.aiter_lines():
                    if line.startswith("id: "):
                        ids.append(line[4:])
            return ids

        tasks = [asyncio.create_task(one({}, True)) for _ in range(n)]
        for _ in range(n):
            await asyncio.wait_for(ready.acquire(), 30)
        await asyncio.to_thread(publish)
        resumer = asyncio.create_task(one(await asyncio.to_thread(late), False))
        got = await asyncio.wait_for(asyncio.gather(*tasks, resumer), 60)
    return statuses, list(got[:-1]), got[-1]


def test_sse_more_followers_than_the_redis_pool_all_get_every_event(
    api: Api, sim: Callable[..., WorkerSim], make_settings: Callable[..., Any]
) -> None:
    """120 followers of one job over a real uvicorn: redis-py's asyncio pool allows 100
    connections by default, and each follower used to hold one; now one reader fans out.
    A follower resuming mid-stream with Last-Event-ID gets the rest without gap or repeat."""
    import asyncio

    app = create_app(
        make_settings(
            redis_prefix=api.settings.redis_prefix,
            ingest=True,
            ingest_block_ms=100,
            sse_redis_connections=100,
            sse_max_streams_per_owner=200,  # one token opens them all here
            # A loaded machine must not time out the shared reader's socket mid-test.
            redis_timeout_s=5.0,
        )
    )
    make_tokens(app.state.services)
    job = api.submit()
    w = sim(job["id"])
    key = api.keys.job(job["id"])
    r = api.services.redis

    def publish() -> None:
        w.running()
        for step in range(1, 4):
            w.metric(step)

    def late() -> dict[str, str]:
        first = r.xrange(key, count=2)[-1][0].decode()  # after the second entry
        for step in range(4, 7):
            w.metric(step)
        w.exited(0)
        return {"Last-Event-ID": first}

    with Uvicorn(app) as server:
        url = f"{server.url}/v1/jobs/{job['id']}/events"
        statuses, seen, resumed = asyncio.run(_follow_many(url, api.headers(), 120, publish, late))

    entries = r.xrange(key)
    ids = [e[0].decode() for e in entries]
    last = Event.from_fields(entries[-1][1])
    assert last.kind == "status" and last.data["status"] == "succeeded"
    assert statuses == [200] * 121
    assert len(ids) >= 9  # running, 6 metrics, exited, and the service's status events
    assert all(got == ids for got in seen), [len(g) for g in seen]
    assert resumed == ids[2:]


def test_streams_are_capped_per_owner_and_close_when_the_token_is_revoked(
    api: Api, sim: Callable[..., WorkerSim], make_settings: Callable[..., Any]
) -> None:
    from service.api.core.auth import revoke_tokens

    app = create_app(
        make_settings(
            redis_prefix=api.settings.redis_prefix, sse_max_streams_per_owner=2, token_cache_s=0.5
        )
    )
    user, token, _, admin = make_tokens(app.state.services)
    services = app.state.services
    with services.sessions() as session, session.begin():
        from service.api.core.auth import create_token

        job_token = create_token(session, api.user)  # a second token of the job's owner
    job = api.submit()
    sim(job["id"]).running()
    mine = {"Authorization": f"Bearer {job_token}"}
    with Uvicorn(app) as server:
        url = f"{server.url}/v1/jobs/{job['id']}/events"
        outs: list[list[str]] = [[], []]
        dones = [threading.Event(), threading.Event()]
        readers = [
            threading.Thread(target=_read_sse, args=(url, mine, out, done))
            for out, done in zip(outs, dones, strict=True)
        ]
        for reader in readers:
            reader.start()
        wait = threading.Event()
        for _ in range(100):  # both streams open (their first line read)
            if all(out for out in outs):
                break
            wait.wait(0.05)
        assert [out[0].split()[1] for out in outs] == ["200", "200"], outs
        third = httpx.get(url, headers=mine, timeout=10)
        assert third.status_code == 429, third.text
        assert int(third.headers["Retry-After"]) > 0
        assert "2 open streams" in third.json()["detail"]
        # Another owner (an admin, who may see the job) is not held back by that owner.
        with (
            httpx.Client(timeout=10) as client,
            client.stream("GET", url, headers={"Authorization": f"Bearer {admin}"}) as resp,
        ):
            assert resp.status_code == 200

        with services.sessions() as session, session.begin():
            assert revoke_tokens(session, name=api.user) >= 1
        # Both open streams end on their own, each saying why, though the job still runs.
        assert all(done.wait(10) for done in dones), outs
        for out in outs:
            events = [e for e in _parse(out[1:]) if e.get("event") == "error"]
            assert events and "revoked" in json.loads(events[-1]["data"])["message"], out
        assert httpx.get(url, headers=mine, timeout=10).status_code == 401
        for reader in readers:
            reader.join(5)
    assert services.hub.open == {}, "every stream was counted out"
    del user, token


def test_a_stream_ends_at_its_maximum_lifetime(
    api: Api, sim: Callable[..., WorkerSim], make_settings: Callable[..., Any]
) -> None:
    app = create_app(make_settings(redis_prefix=api.settings.redis_prefix, sse_max_lifetime_s=1.0))
    make_tokens(app.state.services)
    job = api.submit()
    sim(job["id"]).running()
    with Uvicorn(app) as server:
        lines: list[str] = []
        done = threading.Event()
        reader = threading.Thread(
            target=_read_sse,
            args=(f"{server.url}/v1/jobs/{job['id']}/events", api.headers(), lines, done),
        )
        reader.start()
        assert done.wait(10), "the stream outlived its maximum lifetime"
        reader.join(5)
    assert lines[0].startswith("STATUS 200")
    assert api.get(job["id"])["status"] in ("queued", "running")  # ended by age, not the job


def test_sse_tail_replays_only_the_newest_events(
    api: Api, sim: Callable[..., WorkerSim], make_settings: Callable[..., Any]
) -> None:
    app = create_app(
        make_settings(redis_prefix=api.settings.redis_prefix, ingest=True, ingest_block_ms=100)
    )
    make_tokens(app.state.services)
    job = api.submit()
    w = sim(job["id"])
    w.running()
    for step in range(1, 11):
        w.metric(step)
    w.exited(0)
    r = api.services.redis
    key = api.keys.job(job["id"])

    def ended() -> bool:  # the ingestor has written the final status into the stream
        last = Event.from_fields(r.xrevrange(key, count=1)[0][1])
        return last.kind == "status" and last.data.get("status") == "succeeded"

    with Uvicorn(app) as server:
        for _ in range(200):
            if ended():
                break
            threading.Event().wait(0.05)
        assert ended()
        entries = r.xrange(key)
        lines: list[str] = []
        url = f"{server.url}/v1/jobs/{job['id']}/events?tail=3"
        _read_sse(url, api.headers(), lines, threading.Event())
    got = [e["id"] for e in _parse(lines[1:]) if "id" in e]
    assert len(entries) > 10
    assert got == [e[0].decode() for e in entries[-3:]], (got, len(entries))


def test_refused_streams_leave_healthz_answering_and_cost_no_lookup(
    api: Api, sim: Callable[..., WorkerSim], make_settings: Callable[..., Any]
) -> None:
    """Past the per-owner cap a stream is refused before anything else is done for it (no
    SQL, thread-pool hop or Redis call: a job that does not exist is a 429 too), and while
    a bounded burst of them is refused, /healthz answers. The timings are in
    bench/sse_refused.py; the bound here only guards against a hang."""
    import asyncio

    cap, burst = 3, 120
    app = create_app(
        make_settings(redis_prefix=api.settings.redis_prefix, sse_max_streams_per_owner=cap)
    )
    services = app.state.services
    with services.sessions() as session, session.begin():
        from service.api.core.auth import create_token

        token = create_token(session, api.user)
    job = api.submit()
    sim(job["id"]).running()
    auth = {"Authorization": f"Bearer {token}"}

    async def get(port: int, path: str, hold: asyncio.Event) -> int:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(
                f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: {auth['Authorization']}"
                "\r\n\r\n".encode()
            )
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
            status = int(head.split(b" ", 2)[1])
            if status == 200:
                await hold.wait()
            return status
        finally:
            writer.close()

    async def storm(port: int) -> tuple[list[int], list[int]]:
        hold = asyncio.Event()
        path = f"/v1/jobs/{job['id']}/events"
        held = [asyncio.create_task(get(port, path, hold)) for _ in range(cap)]
        for _ in range(200):  # the cap's streams are open
            if services.hub.open.get(api.user) == cap:
                break
            await asyncio.sleep(0.05)
        assert services.hub.open.get(api.user) == cap
        probes: list[int] = []
        stop, probing = threading.Event(), threading.Event()

        def probe() -> None:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
                while not stop.is_set():
                    probes.append(c.get("/healthz").status_code)
                    probing.set()
                    stop.wait(0.02)

        prober = threading.Thread(target=probe)
        prober.start()
        try:
            # The burst starts once the prober has an answer: on a loaded machine its thread
            # may otherwise start only after a burst that took no time (no probe, nothing shown).
            assert await asyncio.to_thread(probing.wait, 30), "the /healthz prober never answered"
            refused = await asyncio.gather(*(get(port, path, hold) for _ in range(burst)))
            # A job id nobody has: refused at the cap all the same, never looked up.
            refused.append(await get(port, "/v1/jobs/ffffffffffffffff/events", hold))
        finally:
            stop.set()
            await asyncio.to_thread(prober.join, 60)
            hold.set()
        return refused, [*probes, *await asyncio.gather(*held)]

    with Uvicorn(app) as server:
        refused, answered = asyncio.run(storm(server.port))
        assert set(refused) == {429}, sorted(set(refused))
        probes, held = answered[:-cap], answered[-cap:]
        assert held == [200] * cap
        assert probes and set(probes) == {200}, probes
        assert httpx.get(f"{server.url}/healthz", timeout=30).status_code == 200
    assert services.hub.open == {}, "every stream was counted out"
