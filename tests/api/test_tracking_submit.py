"""train.tracking at submit (service.api.jobs.tracking): a tracking URI is an outbound URL,
refused with a 422 naming it when it reaches a private or metadata address (unless the admin
allows private ones); keys never go in a spec; an owner's default applies to specs that name
no tracker."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from service.api.core.auth import create_token
from service.api.core.models import OwnerLimit
from service.api.scheduling.limits import set_limits, set_tracking
from service.cli import main as cli
from tests.api.support import Api

FIELD = ["body", "train", "tracking", "mlflow", "tracking_uri"]


def _post(api: Api, tracking: dict[str, Any]) -> Any:
    body = {"name": "t", "queue": api.queue, "train": {"steps": 2, "tracking": tracking}}
    return api.client.post("/v1/jobs", json=body, headers=api.headers())


PRIVATE = [
    "http://127.0.0.1:5000", "http://localhost:5000", "http://10.0.0.7/", "http://[::1]:80/",
    "http://169.254.169.254/", "http://[::ffff:192.168.1.1]/",
]  # fmt: skip
KEY = "0123456789abcdef0123456789abcdef01234567"  # the shape of a W&B API key


def test_private_uris_and_keys_are_refused_naming_the_field(api: Api) -> None:
    # One app for every case: each submit is refused before anything is stored.
    for uri in PRIVATE:
        resp = _post(api, {"mlflow": {"tracking_uri": uri}})
        assert resp.status_code == 422, resp.text
        [error] = resp.json()["detail"]
        assert error["loc"] == FIELD, error
        if "169.254" not in uri:  # the metadata address: refused by the spec's own rule already
            assert error["msg"].startswith("train.tracking.mlflow.tracking_uri: "), error
            assert "TRAINQ_TRACKING_ALLOW_PRIVATE" in error["msg"]
    for tracking in (
        {"wandb": {"project": "p", "api_key": KEY}},
        {"wandb": {"project": "p", "name": KEY}},
        {"mlflow": {"tracking_uri": "https://user:secret@mlflow.example.com/"}},
    ):
        resp = _post(api, tracking)
        assert resp.status_code == 422, resp.text
        assert resp.json()["detail"][0]["loc"][:3] == ["body", "train", "tracking"]
        assert "key" in resp.text or "credentials" in resp.text
    listed = api.client.get("/v1/jobs", headers=api.headers()).json()
    assert listed["items"] == []  # nothing stored


def _trainq(api: Api, *args: str) -> Any:
    env = {"TRAINQ_DATABASE_URL": api.settings.database_url}
    return CliRunner().invoke(cli.app, ["token", "tracking", *args], env=env)


def test_a_public_uri_is_stored_and_the_owners_default_fills_in(api: Api, tmp_path: Path) -> None:
    spec = tmp_path / "tracking.yaml"
    spec.write_text("wandb: {project: team, api_key: 0123456789abcdef0123456789abcdef01234567}\n")
    refused = _trainq(api, api.user, str(spec))
    assert refused.exit_code == 2 and "keys never go in a spec" in refused.output
    spec.write_text("wandb: {project: team, mode: offline, tags: [nightly]}\n")
    made = _trainq(api, api.user, str(spec))
    assert made.exit_code == 0, made.output
    assert '"project": "team"' in made.stdout and "nightly" in made.stdout
    mine = {"mlflow": {"tracking_uri": "https://93.184.216.34:5000", "experiment": "e"}}
    resp = _post(api, mine)
    assert resp.status_code == 201, resp.text
    stored = resp.json()["train"]["tracking"]
    assert stored["mlflow"]["tracking_uri"] == mine["mlflow"]["tracking_uri"]
    assert stored["wandb"] is None  # the spec's own wins whole

    job = api.submit()  # names no tracker: the owner's default
    assert job["train"]["tracking"]["wandb"]["project"] == "team"
    assert job["train"]["tracking"]["wandb"]["tags"] == ["nightly"]
    resp = _post(api, {})  # opts out
    assert resp.status_code == 201 and resp.json()["train"]["tracking"] == {
        "wandb": None, "mlflow": None,
    }  # fmt: skip
    with api.services.sessions.begin() as session:  # the owner's limits are kept by a clear
        set_limits(session, api.user, max_queued=100)
    cleared = _trainq(api, api.user, "--clear")
    assert cleared.exit_code == 0 and cleared.stdout.strip() == f"{api.user}: tracking=-"
    with api.services.sessions.begin() as session:
        row = session.get(OwnerLimit, api.user)
        assert row is not None and row.tracking is None and row.max_queued == 100
        set_tracking(session, api.user, None)
        set_limits(session, api.user, clear=True)
        assert session.get(OwnerLimit, api.user) is None


def test_an_owners_default_is_checked_as_the_specs_own_would_be(api: Api) -> None:
    """The default is applied once, before the submit decides where to check the spec: a
    default whose URI is private is refused naming the URI, one no longer valid naming
    train.tracking (before any other check, with or without a store to read)."""
    with api.services.sessions.begin() as session:
        set_tracking(session, api.user, {"mlflow": {"tracking_uri": "http://10.0.0.7/"}})
        broken = f"carol-{uuid.uuid4().hex[:6]}"
        broken_token = create_token(session, broken)
        set_tracking(session, broken, {"mlflow": {"tracking_uri": 5}})  # set before a rule
    try:
        plain = {"name": "t", "queue": api.queue, "train": {"steps": 2}}
        resp = api.client.post("/v1/jobs", json=plain, headers=api.headers())
        assert resp.status_code == 422, resp.text
        [error] = resp.json()["detail"]
        assert error["loc"] == FIELD and "TRAINQ_TRACKING_ALLOW_PRIVATE" in error["msg"], error
        assert _post(api, {}).status_code == 201  # opted out: no default, nothing to check

        missing = {**plain, "train": {"steps": 2, "init": {"job": "0" * 32}}}  # a store read
        for body in (plain, missing):
            resp = api.client.post("/v1/jobs", json=body, headers=api.headers(broken_token))
            assert resp.status_code == 422, resp.text
            [error] = resp.json()["detail"]
            assert error["loc"] == ["body", "train", "tracking"], error
            assert "no longer valid" in error["msg"]
    finally:
        with api.services.sessions.begin() as session:
            set_tracking(session, api.user, None)
            set_tracking(session, broken, None)
