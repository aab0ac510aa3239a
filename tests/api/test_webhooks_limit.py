"""``TRAINQ_WEBHOOK_MAX_PER_OWNER`` holds under concurrency: creates through two API replicas
at once never leave an owner more endpoints than the bound (the count is taken under the
owner's lock row), and another owner's room is its own. Real app, PostgreSQL, Redis."""

from __future__ import annotations

import pytest

from tests.api.support import Api, through_two_replicas

HOOK = {"url": "https://hooks.example.com/h", "events": ["job.*"]}


def test_concurrent_creates_through_two_replicas_never_pass_the_bound(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(api.services.settings, "webhook_max_per_owner", 3)
    answers = through_two_replicas(
        api, 12, lambda c: c.post("/v1/webhooks", json=HOOK, headers=api.headers()).status_code
    )
    assert sorted(answers) == [201] * 3 + [422] * 9, answers
    mine = api.client.get("/v1/webhooks", headers=api.headers()).json()["items"]
    assert len(mine) == 3
    refused = api.client.post("/v1/webhooks", json=HOOK, headers=api.headers())
    assert refused.status_code == 422 and "TRAINQ_WEBHOOK_MAX_PER_OWNER" in refused.text
    other = api.client.post("/v1/webhooks", json=HOOK, headers=api.headers(api.other_token))
    assert other.status_code == 201, other.text
