"""``TRAINQ_WEBHOOK_MAX_PER_OWNER`` holds under concurrency: creates through two API replicas
at once never leave an owner more endpoints than the bound (the count is taken under the
owner's lock row), and another owner's room is its own. Real app, PostgreSQL, Redis."""

from __future__ import annotations

import threading

import pytest
from fastapi.testclient import TestClient

from service.api.app import create_app
from tests.api.support import Api

HOOK = {"url": "https://hooks.example.com/h", "events": ["job.*"]}


def test_concurrent_creates_through_two_replicas_never_pass_the_bound(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(api.services.settings, "webhook_max_per_owner", 3)
    replica = create_app(api.services.settings)  # a second API replica: same store and Redis
    answers: list[int] = []
    start = threading.Barrier(12)

    def create(client: TestClient) -> None:
        start.wait(timeout=30)
        answers.append(client.post("/v1/webhooks", json=HOOK, headers=api.headers()).status_code)

    with TestClient(replica) as client2:
        threads = [
            threading.Thread(target=create, args=(api.client if i % 2 else client2,))
            for i in range(12)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    assert sorted(answers) == [201] * 3 + [422] * 9, answers
    mine = api.client.get("/v1/webhooks", headers=api.headers()).json()["items"]
    assert len(mine) == 3
    refused = api.client.post("/v1/webhooks", json=HOOK, headers=api.headers())
    assert refused.status_code == 422 and "TRAINQ_WEBHOOK_MAX_PER_OWNER" in refused.text
    other = api.client.post("/v1/webhooks", json=HOOK, headers=api.headers(api.other_token))
    assert other.status_code == 201, other.text
