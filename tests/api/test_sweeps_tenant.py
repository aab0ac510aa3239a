"""A sweep is a way into the jobs table, so it passes every check a submit makes for its
owner (``service.api.jobs.vet``): its base, each value its space may give a field (when the
sweep is made), and each trial again (when the sweeper makes it). bob (``api.other_token``)
tries to reach alice's job, a folder outside the shared area and a dataset that is not his
through a sweep's space and base; the real app, PostgreSQL and Redis."""

from __future__ import annotations

from typing import Any

import pytest

from service.api.sweeps.sweeper import Sweeper
from tests.api.support import Api

TRAIN = {"steps": 4, "eval": {"every": 0}, "model": {"n_layer": 1, "d_model": 16, "n_head": 2}}


def _ended(api: Api, token: str | None = None) -> str:
    """A job of the token's owner, ended (cancelled while queued)."""
    h = api.headers(token)
    made = api.client.post("/v1/jobs", json={"queue": api.queue, "train": TRAIN}, headers=h)
    assert made.status_code == 201, made.text
    job_id = str(made.json()["id"])
    assert api.client.post(f"/v1/jobs/{job_id}/cancel", headers=h).json()["status"] == "cancelled"
    return job_id


def _sweep(api: Api, space: dict[str, Any], **base: Any) -> dict[str, Any]:
    return {
        "name": "s",
        "base": {"queue": api.queue, "train": {**TRAIN, **base}},
        "space": space,
        "method": "grid",
        "metric": "loss",
        "budget": 2,
        "parallelism": 2,
    }


def _choice(*values: Any) -> dict[str, Any]:
    return {"type": "choice", "values": list(values)}


@pytest.mark.parametrize(
    ("path", "values", "says"),
    [
        ("train.init.job", ["ALICE"], "not found (or not yours)"),
        ("train.data.path", ["../etc"], "train.data.path"),
        ("train.data.path", ["datasets/x/corpus"], "train.data.path"),
        ("train.init.path", ["/etc"], "train.init.path"),
        ("train.data.dataset", ["not-his"], "not found (or not yours)"),
        ("train.tracking.mlflow.tracking_uri", ["http://169.254.169.254/"], "tracking_uri"),
    ],
)
def test_a_space_value_another_owner_owns_or_no_submit_allows_is_a_422(
    api: Api, path: str, values: list[Any], says: str
) -> None:
    alice_job = _ended(api)
    values = [alice_job if v == "ALICE" else v for v in values]
    bob = api.headers(api.other_token)
    # the first value is his own, allowed: the refused one is the second a trial may take
    own = {"train.init.job": _ended(api, api.other_token), "train.data.path": "tiny"}.get(path)
    space = {path: _choice(*([own] if own else []), *values)}
    resp = api.client.post("/v1/sweeps", json=_sweep(api, space), headers=bob)
    assert resp.status_code == 422, resp.text
    detail = resp.json()["detail"]
    assert detail[0]["loc"] == ["body", "space", path], detail
    assert says in detail[0]["msg"], detail
    listed = api.client.get("/v1/sweeps", headers=bob).json()["items"]
    assert listed == []  # nothing stored


def test_a_base_that_starts_from_another_owners_job_is_a_422_at_base(api: Api) -> None:
    alice_job = _ended(api)
    space = {"train.optim.lr": _choice(1e-3, 1e-2)}
    body = _sweep(api, space, init={"job": alice_job})
    resp = api.client.post("/v1/sweeps", json=body, headers=api.headers(api.other_token))
    assert resp.status_code == 422, resp.text
    assert resp.json()["detail"][0]["loc"] == ["body", "base", "train", "init", "job"]
    assert api.client.get("/v1/sweeps", headers=api.headers(api.other_token)).json()["items"] == []


def test_each_trial_is_checked_again_when_the_sweeper_makes_it(api: Api) -> None:
    """bob's sweep starts from his own jobs; he deletes some before the sweeper's pass. A
    base that no longer passes (its init job gone) makes the next trial wait, saying why,
    with nothing of the budget spent; a trial whose own value no longer passes is not run,
    counts as failed, and the sweep says which."""
    bob_token = api.other_token
    bob = api.headers(bob_token)
    s = api.services
    sweeper = Sweeper(s.settings, s.sessions, s.redis, s.dispatcher)
    start = _ended(api, bob_token)
    space = {"train.optim.lr": _choice(1e-3, 1e-2)}
    made = api.client.post("/v1/sweeps", json=_sweep(api, space, init={"job": start}), headers=bob)
    assert made.status_code == 201, made.text
    waits = made.json()["id"]
    kept, gone = _ended(api, bob_token), _ended(api, bob_token)
    space = {"train.init.job": _choice(kept, gone)}
    made = api.client.post("/v1/sweeps", json=_sweep(api, space), headers=bob)
    assert made.status_code == 201, made.text
    one_refused = made.json()["id"]
    for job_id in (start, gone):
        assert api.client.delete(f"/v1/jobs/{job_id}", headers=bob).status_code == 204
    sweeper.run_once()
    sweep = api.client.get(f"/v1/sweeps/{waits}", headers=bob).json()
    assert sweep["status"] == "running" and sweep["proposed"] == 0, sweep
    assert sweep["trials"] == [], sweep
    assert sweep["message"].startswith("the next trial waits: train.init.job: "), sweep
    assert f"job {start} not found" in sweep["message"], sweep
    sweep = api.client.get(f"/v1/sweeps/{one_refused}", headers=bob).json()
    assert sweep["proposed"] == 2, sweep
    assert [t["params"] for t in sweep["trials"]] == [{"train.init.job": kept}], sweep
    assert f"trial 1 was not run: train.init.job: job {gone} not found" in sweep["message"]
    trial = api.client.get(f"/v1/jobs/{sweep['trials'][0]['job_id']}", headers=bob).json()
    assert trial["train"]["init"]["job"] == kept
    api.client.post(f"/v1/jobs/{trial['id']}/cancel", headers=bob)


def test_an_admins_sweep_keeps_its_rights_while_its_admin_token_lives(api: Api) -> None:
    """Trials are checked as their owner: an admin's sweep above the priority others may use
    makes its trials (a request-less check must not take the admin for a plain owner)."""
    admin = api.headers(api.admin_token)
    body = _sweep(api, {"train.optim.lr": _choice(1e-3, 1e-2)})
    body["base"]["priority"] = api.settings.max_priority + 5
    made = api.client.post("/v1/sweeps", json=body, headers=admin)
    assert made.status_code == 201, made.text
    s = api.services
    Sweeper(s.settings, s.sessions, s.redis, s.dispatcher).run_once()
    sweep = api.client.get(f"/v1/sweeps/{made.json()['id']}", headers=admin).json()
    assert len(sweep["trials"]) == 2, sweep
    for trial in sweep["trials"]:
        job = api.client.get(f"/v1/jobs/{trial['job_id']}", headers=admin).json()
        assert job["priority"] == api.settings.max_priority + 5
        api.client.post(f"/v1/jobs/{trial['job_id']}/cancel", headers=admin)
