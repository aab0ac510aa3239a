"""Per-owner limits (service.api.scheduling.limits): the priority an owner may ask for (403 above
it, raised with ``trainq token limits``; admins unlimited), an owner's own submit limits over the
settings (429 naming where the limit is set), and the per-job runtime rules (max_runtime_s
required above a rank count, a per-queue default deadline stored on the job)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

from fastapi.testclient import TestClient
from sqlalchemy import create_engine, delete, pool
from typer.testing import CliRunner

from service.api.app import create_app
from service.api.core.models import OWNER_LIMITS
from service.api.core.settings import Settings
from service.api.scheduling.limits import running_caps, set_limits
from service.cli import main as cli
from tests.api.support import forget_jobs_since, make_tokens

MakeSettings = Callable[..., Settings]


class Owners(NamedTuple):
    user: str  # the owner of ``token``
    token: str
    other: str  # another owner's token
    admin: str  # an admin token
    other_name: str


@contextmanager
def app_with(make_settings: MakeSettings, **overrides: Any) -> Iterator[tuple[Any, Any, Owners]]:
    """(a TestClient, the app's services, this test's owners); their owner_limits rows and
    the jobs made are removed afterwards."""
    started_ms = int(time.time() * 1000)
    app = create_app(make_settings(token_cache_s=0, **overrides))
    services = app.state.services
    user, token, other, admin = make_tokens(services)
    owners = Owners(user, token, other, admin, services.tokens.resolve(f"Bearer {other}").name)
    try:
        with TestClient(app) as client:
            yield client, services, owners
    finally:
        url = services.settings.database_url
        names = [user, owners.other_name, services.tokens.resolve(f"Bearer {admin}").name]
        engine = create_engine(url, poolclass=pool.NullPool)
        try:
            with engine.begin() as conn:
                conn.execute(delete(OWNER_LIMITS).where(OWNER_LIMITS.c.owner.in_(names)))
        finally:
            engine.dispose()
        forget_jobs_since(url, started_ms)


def _post(client: Any, token: str, params: dict[str, Any] | None = None, **spec: Any) -> Any:
    body = {"name": "t", "queue": f"q{uuid.uuid4().hex[:8]}", "train": {"steps": 5}, **spec}
    headers = {"Authorization": f"Bearer {token}"}
    return client.post("/v1/jobs", json=body, headers=headers, params=params or {})


def _trainq(url: str, *args: str) -> Any:
    env = {"TRAINQ_DATABASE_URL": url}
    return CliRunner().invoke(cli.app, ["token", "limits", *args], env=env)


def test_priority_above_max_is_403_until_an_admin_raises_it(make_settings: MakeSettings) -> None:
    with app_with(make_settings) as (client, services, owners):
        user, token, admin = owners.user, owners.token, owners.admin
        url = services.settings.database_url
        refused = _post(client, token, priority=5)
        assert refused.status_code == 403, refused.text
        detail = refused.json()["detail"]
        assert "priority 5 is above the 0" in detail and "TRAINQ_MAX_PRIORITY=0" in detail
        assert f"trainq token limits {user} --max-priority N" in detail
        dry = _post(client, token, params={"dry_run": "true"}, priority=5)
        assert dry.status_code == 403  # a dry run answers what the submit would
        assert _post(client, token, priority=0).status_code == 201
        assert _post(client, admin, priority=1000).status_code == 201  # admins: no limit

        made = _trainq(url, user, "--max-priority", "5")
        assert made.exit_code == 0, made.output
        line = f"{user}: max_priority=5 max_running=- max_queued=- submits_per_minute=-"
        assert made.stdout.strip() == line
        job = _post(client, token, priority=5)
        assert job.status_code == 201 and job.json()["priority"] == 5
        above = _post(client, token, priority=6)
        assert above.status_code == 403
        assert "max_priority=5 set for this owner" in above.json()["detail"]

        # Only the options given change; the listing shows every owner's row.
        assert _trainq(url, user, "--max-running", "4").exit_code == 0
        listed = _trainq(url)
        assert listed.exit_code == 0 and listed.stdout.startswith("owner\tmax_priority")
        assert f"{user}\t5\t4\t-\t-" in listed.stdout.splitlines()
        with services.reader.connect() as conn:
            default, caps = running_caps(conn, services.settings)
        assert default is None and caps[user] == 4

        bad = _trainq(url, user, "--max-queued", "-1")
        assert bad.exit_code == 2 and "negative" in bad.output
        assert _trainq(url, user, "--max-running", "x").exit_code == 2
        assert _trainq(url, user, "--max-priority", "-3").exit_code == 0  # a priority may be
        cleared = _trainq(url, user, "--clear")
        assert cleared.exit_code == 0 and "max_priority=-" in cleared.stdout
        assert f"\n{user}\t" not in _trainq(url).stdout
        assert _post(client, token, priority=5).status_code == 403


def test_owner_submit_limits_override_the_settings(make_settings: MakeSettings) -> None:
    limits = {"submits_per_minute": 1, "max_queued_per_owner": 0}
    with app_with(make_settings, **limits) as (client, services, owners):
        user, token, other, admin = owners[:4]
        with services.sessions() as session, session.begin():
            set_limits(session, user, submits_per_minute=3)
            set_limits(session, owners.other_name, submits_per_minute=0, max_queued=2)
        assert [_post(client, token).status_code for _ in range(3)] == [201] * 3
        refused = _post(client, token)
        assert refused.status_code == 429
        assert "submits_per_minute=3 set for this owner" in refused.json()["detail"]
        # Lifted per-minute limit (0), its own queue limit instead.
        assert [_post(client, other).status_code for _ in range(2)] == [201] * 2
        full = _post(client, other)
        assert full.status_code == 429 and "max_queued=2 set for this owner" in full.text
        # An owner without a row: the settings.
        assert _post(client, admin).status_code == 201
        assert "TRAINQ_SUBMITS_PER_MINUTE=1" in _post(client, admin).json()["detail"]


def test_runtime_required_above_ranks_and_default_deadline(make_settings: MakeSettings) -> None:
    queue = f"q{uuid.uuid4().hex[:8]}"
    rules = {"max_runtime_required_ranks": 4, "default_max_runtime_s": {queue: 600, "*": 3600}}
    with app_with(make_settings, **rules) as (client, _, owners):
        token = owners.token
        big: dict[str, Any] = {"nodes": 2, "procs_per_node": 4}
        refused = _post(client, token, **big)
        assert refused.status_code == 422
        assert [e["loc"] for e in refused.json()["detail"]] == [["body", "max_runtime_s"]]
        assert "8 ranks" in refused.text and "TRAINQ_MAX_RUNTIME_REQUIRED_RANKS=4" in refused.text
        dry = _post(client, token, params={"dry_run": "true"}, **big)
        assert dry.status_code == 422
        given = _post(client, token, max_runtime_s=100, **big)
        assert given.status_code == 201 and given.json()["max_runtime_s"] == 100

        headers = {"Authorization": f"Bearer {token}"}
        cases: list[tuple[dict[str, Any], int]] = [({"queue": queue}, 600), ({}, 3600)]
        for spec, deadline in cases:
            made = _post(client, token, procs_per_node=4, **spec)  # 4 ranks: not required
            assert made.status_code == 201, made.text
            job = client.get(f"/v1/jobs/{made.json()['id']}", headers=headers).json()
            assert job["max_runtime_s"] == deadline
