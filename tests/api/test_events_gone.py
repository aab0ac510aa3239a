"""The events feed after retention pruned events (service.api.events.router): a cursor that
missed a pruned event of its owner is a 410 naming ``after`` with the oldest cursor to read on
from; ``after=0``, a cursor at or past the owner's mark, and every cursor of an owner none of
whose events were pruned read on as ever. Through the HTTP API, on PostgreSQL and SQLite."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import delete, insert, select, update

from service.api.app import create_app
from service.api.core import migrate
from service.api.core.auth import create_token
from service.api.core.models import (
    EVENTS,
    EVENTS_PRUNED,
    WEBHOOK_DELIVERIES,
    WEBHOOKS,
    utcnow,
)
from service.api.core.settings import Settings
from service.api.scheduling.retention import Retention
from tests.api.support import Api, make_tokens


@pytest.fixture()
def sqlite_api(make_settings: Callable[..., Settings], tmp_path: Path) -> Iterator[Api]:
    url = f"sqlite:///{tmp_path / 'embedded' / 'trainq.db'}"
    migrate.upgrade(url)
    app = create_app(make_settings(database_url=url))
    user, token, other, admin = make_tokens(app.state.services)
    with TestClient(app) as client:
        yield Api(app, client, app.state.services, user, token, other, admin)


def _feed(api: Api, token: str, after: int) -> Any:
    return api.client.get(
        "/v1/events", params={"after": str(after), "limit": 100}, headers=api.headers(token)
    )


def _ids(api: Api, token: str, after: int) -> list[int]:
    resp = _feed(api, token, after)
    assert resp.status_code == 200, resp.text
    return [int(e["id"]) for e in resp.json()["items"]]


def _gone(api: Api, token: str, after: int, oldest: int) -> None:
    resp = _feed(api, token, after)
    assert resp.status_code == 410, resp.text
    body = resp.json()
    assert body["oldest_cursor"] == str(oldest)
    (err,) = body["detail"]
    assert err["loc"] == ["query", "after"] and err["type"] == "cursor_expired"
    assert f"after={oldest}" in err["msg"] and "after=0" in err["msg"]


def _prune(api: Api) -> None:
    on = api.settings.model_copy(update={"retention_days": 0, "events_retention_days": 30})
    Retention(on, api.services.sessions, api.services.redis).run_once()


def _scenario(api: Api) -> None:
    names = {who: f"{who}-{uuid.uuid4().hex[:8]}" for who in ("alice", "bob", "carol")}
    with api.services.sessions() as session, session.begin():
        tokens = {who: create_token(session, name) for who, name in names.items()}
    now = utcnow()
    old, recent = now - timedelta(days=40), now - timedelta(days=1)
    endpoint = uuid.uuid4().hex
    with api.services.sessions() as session, session.begin():

        def event(who: str, when: Any) -> int:
            row = {"owner": names[who], "type": "job.running", "job_id": None, "data": {}}
            stmt = insert(EVENTS).values(**row, created_at=when).returning(EVENTS.c.id)
            return int(session.execute(stmt).scalar_one())

        # ids are global and ascending: carol's first cursor is older than every pruned one
        c0 = event("carol", recent)
        a1, b1, held, a2 = (event(w, old) for w in ("alice", "bob", "alice", "alice"))
        c1, b2, a3 = (event(w, recent) for w in ("carol", "bob", "alice"))
        session.execute(
            insert(WEBHOOKS).values(
                id=endpoint, owner=names["alice"], url="https://hooks.example.com/h",
                events=["job.*"], secret="whsec_" + "A" * 32, enabled=True, after_event=a3,
                failures=0, created_at=old, updated_at=old,
            )
        )  # fmt: skip
        session.execute(
            insert(WEBHOOK_DELIVERIES).values(
                endpoint_id=endpoint, event_id=held, job_id=None, status="pending", attempts=1,
                next_attempt_at=old, give_up_at=now, created_at=old, updated_at=old,
            )
        )  # fmt: skip
    alice, bob, carol = tokens["alice"], tokens["bob"], tokens["carol"]
    assert _ids(api, alice, a1) == [held, a2, a3]  # nothing pruned yet: as ever

    _prune(api)
    assert _ids(api, alice, 0) == [held, a3]  # the start is never too old
    _gone(api, alice, a1, oldest=a2)  # a2, after it, is gone
    _gone(api, alice, held, oldest=a2)
    _gone(api, alice, c0, oldest=a2)
    assert _ids(api, alice, a2) == [a3]  # at the mark: nothing of alice's after it is gone
    assert _ids(api, alice, a3) == []
    _gone(api, bob, c0, oldest=b1)
    assert _ids(api, bob, b1) == [b2]
    # carol lost nothing: her cursor is older than alice's and bob's pruned events, and valid
    assert _ids(api, carol, c0) == [c1]
    assert _ids(api, carol, 0) == [c0, c1]

    # The held event's delivery ends: the next pass prunes it, and the mark stays (a lower id
    # never lowers it)
    with api.services.sessions() as session, session.begin():
        session.execute(
            update(WEBHOOK_DELIVERIES)
            .where(WEBHOOK_DELIVERIES.c.event_id == held)
            .values(status="delivered", updated_at=old)
        )
    _prune(api)
    assert _ids(api, alice, 0) == [a3]
    assert _ids(api, alice, a2) == [a3]
    _gone(api, alice, held, oldest=a2)
    with api.services.sessions() as session:
        marks = dict(
            session.execute(
                select(EVENTS_PRUNED.c.owner, EVENTS_PRUNED.c.through_id).where(
                    EVENTS_PRUNED.c.owner.in_(list(names.values()))
                )
            ).all()
        )
    assert marks == {names["alice"]: a2, names["bob"]: b1}
    with api.services.sessions() as session, session.begin():
        session.execute(delete(WEBHOOKS).where(WEBHOOKS.c.id == endpoint))


def test_a_cursor_that_missed_pruned_events_is_a_410_per_owner(api: Api) -> None:
    _scenario(api)


def test_the_same_on_sqlite(sqlite_api: Api) -> None:
    _scenario(sqlite_api)


def test_the_410_is_documented(api: Api) -> None:
    spec = api.client.get("/openapi.json").json()
    answers = spec["paths"]["/v1/events"]["get"]["responses"]
    schema = answers["410"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[-1]
    assert set(spec["components"]["schemas"][schema]["properties"]) == {"detail", "oldest_cursor"}
