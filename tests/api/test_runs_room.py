"""An owner's room for runs (``TRAINQ_RUNS_MAX_OWNER_BYTES``, service.api.jobs.room): each
job counts its run folder's worst case (the dry run's ``disk.run_bytes``) until it is removed,
checked at submit under the owner's lock, so concurrent submits through two API replicas
never pass the bound together."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from sqlalchemy import func, select

from service.api.core.models import JOBS
from tests.api.support import Api, through_two_replicas

TINY = {"n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 32, "vocab_size": 256}


def _body(api: Api, **extra: Any) -> dict[str, Any]:
    return {"name": "room", "queue": api.queue, "train": {"model": TINY, "steps": 5}, **extra}


def _run_bytes(api: Api) -> int:
    r = api.client.post(
        "/v1/jobs", params={"dry_run": "true"}, json=_body(api), headers=api.headers()
    )
    assert r.status_code == 200, r.text
    return int(r.json()["disk"]["run_bytes"])


def _held(api: Api, owner: str) -> tuple[int, int]:
    """(the owner's jobs, the bytes they count) as stored."""
    with api.services.sessions() as session:
        row = session.execute(
            select(func.count(), func.coalesce(func.sum(JOBS.c.disk_bytes), 0)).where(
                JOBS.c.owner == owner
            )
        ).one()
    return int(row[0]), int(row[1])


def _bound(api: Api, monkeypatch: pytest.MonkeyPatch, jobs: int) -> int:
    """Room for ``jobs`` of ``_body``'s; the bytes one counts."""
    each = _run_bytes(api)
    assert each > 0
    monkeypatch.setattr(api.services.settings, "runs_max_owner_bytes", jobs * each + each // 2)
    return each


def test_an_owner_is_refused_past_the_bound_others_are_not_and_a_removal_gives_room(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    each = _bound(api, monkeypatch, 3)
    made = []
    for _ in range(3):
        r = api.client.post("/v1/jobs", json=_body(api), headers=api.headers())
        assert r.status_code == 201, r.text
        made.append(r.json()["id"])
    assert _held(api, api.user) == (3, 3 * each)
    refused = api.client.post("/v1/jobs", json=_body(api), headers=api.headers())
    assert refused.status_code == 422, refused.text
    [err] = refused.json()["detail"]
    assert err["loc"] == ["body", "train", "checkpoint", "keep"]
    assert "TRAINQ_RUNS_MAX_OWNER_BYTES" in err["msg"] and "trainq rm" in err["msg"]
    assert _held(api, api.user) == (3, 3 * each), "a refusal stores nothing"
    # Another owner has room of its own.
    theirs = api.client.post("/v1/jobs", json=_body(api), headers=api.headers(api.other_token))
    assert theirs.status_code == 201, theirs.text
    # A job removed gives its room back (a queued one ends at once when cancelled).
    cancel = api.client.post(f"/v1/jobs/{made[0]}/cancel", headers=api.headers())
    assert cancel.status_code == 200 and cancel.json()["status"] == "cancelled", cancel.text
    still = api.client.post("/v1/jobs", json=_body(api), headers=api.headers())
    assert still.status_code == 422, "a finished run keeps its folder till it is removed"
    gone = api.client.delete(f"/v1/jobs/{made[0]}", headers=api.headers())
    assert gone.status_code == 204, gone.text
    again = api.client.post("/v1/jobs", json=_body(api), headers=api.headers())
    assert again.status_code == 201, again.text


def test_a_replay_at_the_bound_answers_its_job(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    _bound(api, monkeypatch, 1)
    headers = {**api.headers(), "Idempotency-Key": f"k-{uuid.uuid4().hex}"}
    first = api.client.post("/v1/jobs", json=_body(api), headers=headers)
    assert first.status_code == 201, first.text
    replay = api.client.post("/v1/jobs", json=_body(api), headers=headers)
    assert replay.status_code == 200, replay.text
    assert replay.json()["id"] == first.json()["id"]
    other_spec = api.client.post("/v1/jobs", json=_body(api, name="else"), headers=headers)
    assert other_spec.status_code == 409, other_spec.text  # the key's conflict, as ever
    fresh = api.client.post("/v1/jobs", json=_body(api), headers=api.headers())
    assert fresh.status_code == 422, fresh.text


def test_concurrent_submits_through_two_replicas_never_pass_the_bound(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    each = _bound(api, monkeypatch, 5)
    answers = through_two_replicas(
        api, 16, lambda c: c.post("/v1/jobs", json=_body(api), headers=api.headers()).status_code
    )
    assert sorted(answers) == [201] * 5 + [422] * 11, answers
    assert _held(api, api.user) == (5, 5 * each)


def test_without_a_bound_the_estimate_is_still_kept(api: Api) -> None:
    assert api.settings.runs_max_owner_bytes == 0  # the default: no bound
    each = _run_bytes(api)
    for _ in range(3):
        r = api.client.post("/v1/jobs", json=_body(api), headers=api.headers())
        assert r.status_code == 201, r.text
    # Counted all the same, so a bound set later counts the jobs already there.
    assert _held(api, api.user) == (3, 3 * each)
