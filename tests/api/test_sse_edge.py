"""Streams past the per-owner cap refused at the app's edge (``service.api.app.StreamRefusal``),
before routing, over a real HTTP server: the same 429 the route gives, 401 before it, other
owners untouched, a closed stream's slot given back; ``GET /healthz`` answered at the edge."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from service.api.app import StreamRefusal, create_app
from service.api.core.deps import Services
from service.api.streams.router import EVENTS_PATH, LOGS_PATH, stream_route
from tests.api.support import Api, Uvicorn, WorkerSim
from tests.e2e.system import wait_for

CAP = 2
# Headers that differ between any two answers, whoever gives them.
VARYING = {"date", "server"}


def _answer(r: httpx.Response) -> tuple[int, bytes, dict[str, str]]:
    headers = {k: v for k, v in r.headers.items() if k not in VARYING}
    return r.status_code, r.content, headers


def _edge_call(services: Services, path: str, query: bytes, authorization: str | None) -> Any:
    """``StreamRefusal`` on its own, as the edge calls it: what it returns and sends."""
    headers = [(b"host", b"test")]
    if authorization is not None:
        headers.append((b"authorization", authorization.encode()))
    scope = {"type": "http", "method": "GET", "path": path, "query_string": query}
    scope["headers"] = headers
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    answered = asyncio.run(StreamRefusal(services)(scope, receive, send))
    return answered, sent


def _bearer(api: Api) -> str:
    return api.headers()["Authorization"]


@pytest.fixture()
def capped(api: Api, sim: Callable[..., WorkerSim], make_settings: Callable[..., Any]) -> Any:
    # token_cache_s: the direct edge calls below resolve the token from the cache the HTTP
    # requests filled (they run on a loop of their own, not the server's).
    app = create_app(
        make_settings(
            redis_prefix=api.settings.redis_prefix,
            sse_max_streams_per_owner=CAP,
            token_cache_s=60,
        )
    )
    job = api.submit()
    sim(job["id"]).running()
    with Uvicorn(app) as server:
        yield app.state.services, server, job["id"]


def test_over_cap_streams_are_refused_at_the_edge_with_the_routes_answer(
    api: Api, capped: Any
) -> None:
    services, server, job_id = capped
    events = f"{server.url}/v1/jobs/{job_id}/events"
    logs = f"{server.url}/v1/jobs/{job_id}/logs"
    mine = api.headers()
    with httpx.Client(timeout=10) as client, contextlib.ExitStack() as held:
        for _ in range(CAP):
            resp = held.enter_context(client.stream("GET", events, headers=mine))
            assert resp.status_code == 200
        assert services.hub.open[api.user] == CAP

        edge = client.get(events, headers=mine)
        # A repeated parameter is left to the route (``stream_route``), which refuses it.
        routed = client.get(events, params=[("tail", "1"), ("tail", "1")], headers=mine)
        assert edge.status_code == 429, edge.text
        assert _answer(edge) == _answer(routed)
        assert edge.headers["retry-after"] == "10"
        assert edge.headers["content-type"] == "application/json"
        assert edge.json() == {
            "detail": f"'{api.user}' has {CAP} open streams already"
            " (TRAINQ_SSE_MAX_STREAMS_PER_OWNER); close one first"
        }
        # The logs follow route is a stream too, with the same answer; a plain read is not.
        assert _answer(client.get(logs, params={"follow": "true"}, headers=mine)) == _answer(edge)
        assert client.get(logs, params={"follow": "yes"}, headers=mine).status_code == 429
        assert client.get(logs, headers=mine).status_code == 200
        # Bad input is still named before the cap is: a 422, not a 429.
        bad = client.get(events, params={"tail": "100001"}, headers=mine)
        assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["query", "tail"]

        # The edge's own answer, with no app behind it, is that same 429.
        answered, sent = _edge_call(services, f"/v1/jobs/{job_id}/events", b"", _bearer(api))
        assert answered == (EVENTS_PATH, 429)
        start, body = sent
        assert start["status"] == 429 and body["body"] == edge.content
        assert {k.decode(): v.decode() for k, v in start["headers"]} == _answer(edge)[2]
        answered, _ = _edge_call(services, f"/v1/jobs/{job_id}/logs", b"follow=1", _bearer(api))
        assert answered == (LOGS_PATH, 429)
        assert services.hub.open[api.user] == CAP, "a refusal counts nothing"


def test_unauthenticated_is_401_and_other_owners_are_not_held_back(api: Api, capped: Any) -> None:
    services, server, job_id = capped
    path = f"/v1/jobs/{job_id}/events"
    url = server.url + path
    with httpx.Client(timeout=10) as client, contextlib.ExitStack() as held:
        for _ in range(CAP):
            held.enter_context(client.stream("GET", url, headers=api.headers()))
        assert services.hub.open[api.user] == CAP

        for headers in ({}, {"Authorization": "Bearer tq_nobody"}, {"Authorization": "Basic x"}):
            r = client.get(url, headers=headers)
            assert r.status_code == 401, (headers, r.text)
            assert r.headers["www-authenticate"] == "Bearer"
            answered, sent = _edge_call(services, path, b"", headers.get("Authorization"))
            assert answered is None and sent == [], "the edge leaves it to the route"

        # An admin (who may see the job) streams it; another owner is not refused either:
        # the route looks the job up for it, and it is not that owner's (404, not 429).
        with client.stream("GET", url, headers=api.headers(api.admin_token)) as resp:
            assert resp.status_code == 200
        other = client.get(url, headers=api.headers(api.other_token))
        assert other.status_code == 404, other.text
        answered, sent = _edge_call(services, path, b"", f"Bearer {api.other_token}")
        assert answered is None and sent == []


def test_a_closed_streams_slot_admits_a_new_one(api: Api, capped: Any) -> None:
    services, server, job_id = capped
    url = f"{server.url}/v1/jobs/{job_id}/events"
    with httpx.Client(timeout=10) as client:
        with contextlib.ExitStack() as held:
            for _ in range(CAP):
                held.enter_context(client.stream("GET", url, headers=api.headers()))
            assert client.get(url, headers=api.headers()).status_code == 429
        # The clients hung up: each stream ends on the server and gives its slot back.
        wait_for(lambda: api.user not in services.hub.open, 10, "the streams counted out", 0.02)
        assert services.hub.total == 0
        answered, sent = _edge_call(services, f"/v1/jobs/{job_id}/events", b"", _bearer(api))
        assert answered is None and sent == []
        with client.stream("GET", url, headers=api.headers()) as resp:
            assert resp.status_code == 200
            assert services.hub.open[api.user] == 1
    wait_for(lambda: services.hub.open == {}, 10, "the last stream counted out", 0.02)


def test_healthz_is_answered_at_the_edge_as_the_route_documents(api: Api, capped: Any) -> None:
    _, server, _ = capped
    r = httpx.get(f"{server.url}/healthz", timeout=10)
    assert _answer(r) == (
        200,
        b'{"status":"ok"}',
        {"content-length": "15", "content-type": "application/json"},
    )
    schema = httpx.get(f"{server.url}/openapi.json", timeout=10).json()
    assert "/healthz" in schema["paths"]
    # Only GET is answered there; anything else goes to the router, as before.
    assert httpx.post(f"{server.url}/healthz", timeout=10).status_code == 405


@pytest.mark.parametrize(
    ("path", "query", "last_event_id", "route"),
    [
        ("/v1/jobs/ab12/events", b"", [], EVENTS_PATH),
        ("/v1/jobs/ab12/events", b"tail=100000", [b"1-0"], EVENTS_PATH),
        ("/v1/jobs/ab12/logs", b"follow=true&tail=5&rank=0&attempt=1000", [], LOGS_PATH),
        ("/v1/jobs/ab12/logs", b"follow=1", [], LOGS_PATH),
        # Not a stream, or not one the route would accept as it is: left to the route.
        ("/v1/jobs/ab12/logs", b"", [], None),
        ("/v1/jobs/ab12/logs", b"follow=false", [], None),
        ("/v1/jobs/ab12/logs", b"follow=true&attempt=0", [], None),
        ("/v1/jobs/ab12/events", b"tail=100001", [], None),
        ("/v1/jobs/ab12/events", b"tail=-1", [], None),
        ("/v1/jobs/ab12/events", b"tail=%C2%B2", [], None),  # a digit, not an ASCII one
        ("/v1/jobs/ab12/events", b"tail=1&tail=2", [], None),
        ("/v1/jobs/ab12/events", b"other=1", [], None),
        ("/v1/jobs/ab12/events", b"", [b"1" * 65], None),
        ("/v1/jobs/ab12/events", b"", [b"1-0", b"2-0"], None),
        ("/v1/jobs/AB12/events", b"", [], None),
        ("/v1/jobs/" + "a" * 33 + "/events", b"", [], None),
        ("/v1/jobs/ab12/events/", b"", [], None),
    ],
)
def test_stream_route_takes_only_what_the_route_accepts(
    path: str, query: bytes, last_event_id: list[bytes], route: str | None
) -> None:
    assert stream_route(path, query, last_event_id) == route
