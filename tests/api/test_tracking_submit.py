"""train.tracking at submit (service.api.jobs.tracking): a tracking URI is an outbound URL,
refused with a 422 naming it when it reaches a private or metadata address (unless the admin
allows private ones); keys never go in a spec; an owner's default applies to specs that name
no tracker."""

from __future__ import annotations

from typing import Any

import pytest

from service.api.scheduling.limits import set_tracking
from tests.api.support import Api

FIELD = ["body", "train", "tracking", "mlflow", "tracking_uri"]


def _post(api: Api, tracking: dict[str, Any]) -> Any:
    body = {"name": "t", "queue": api.queue, "train": {"steps": 2, "tracking": tracking}}
    return api.client.post("/v1/jobs", json=body, headers=api.headers())


@pytest.mark.parametrize(
    "uri",
    ["http://127.0.0.1:5000", "http://localhost:5000", "http://10.0.0.7/", "http://[::1]:80/",
     "http://169.254.169.254/", "http://[::ffff:192.168.1.1]/"],
)  # fmt: skip
def test_a_private_tracking_uri_is_refused_naming_the_field(api: Api, uri: str) -> None:
    resp = _post(api, {"mlflow": {"tracking_uri": uri}})
    assert resp.status_code == 422, resp.text
    [error] = resp.json()["detail"]
    assert error["loc"] == FIELD, error
    if "169.254" not in uri:  # the metadata address: refused by the spec's own rule already
        assert error["msg"].startswith("train.tracking.mlflow.tracking_uri: "), error
        assert "TRAINQ_TRACKING_ALLOW_PRIVATE" in error["msg"]


@pytest.mark.parametrize(
    "tracking",
    [
        {"wandb": {"project": "p", "api_key": "0123456789abcdef0123456789abcdef01234567"}},
        {"wandb": {"project": "p", "name": "0123456789abcdef0123456789abcdef01234567"}},
        {"mlflow": {"tracking_uri": "https://user:secret@mlflow.example.com/"}},
    ],
)
def test_keys_in_the_spec_are_refused(api: Api, tracking: dict[str, Any]) -> None:
    resp = _post(api, tracking)
    assert resp.status_code == 422, resp.text
    assert resp.json()["detail"][0]["loc"][:3] == ["body", "train", "tracking"]
    assert "key" in resp.text or "credentials" in resp.text


def test_a_public_uri_is_stored_and_the_owners_default_fills_in(api: Api) -> None:
    default = {"wandb": {"project": "team", "mode": "offline", "tags": ["nightly"]}}
    with api.services.sessions.begin() as session:
        set_tracking(session, api.user, default)
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
