"""The OpenAI-compatible routes without a worker: the ``openai`` SDK against the API
(in-process, real PostgreSQL and Redis) for what the API answers alone — the model list,
errors in OpenAI's shape (the SDK's exceptions carry ``type``, ``code`` and ``param``) —
and the in-flight slots a fanned-out call takes."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from typing import Any

import openai
import pytest
from sqlalchemy import update

from service.api.core.models import JOBS
from service.api.generation.openai_errors import is_openai_path, param_of
from tests.api.support import Api

pytestmark = pytest.mark.timeout(60)


def _sdk(api: Api, token: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://testserver/v1",
        api_key=token or api.token,
        http_client=api.client,
        max_retries=0,
    )


def _job(api: Api, steps: tuple[int, ...] = (2, 4), status: str = "succeeded",
         token: str | None = None, seq_len: int = 48) -> str:  # fmt: skip
    body = {"name": "m", "queue": api.queue,
            "train": {"steps": 5, "model": {"seq_len": seq_len}}}  # fmt: skip
    r = api.client.post(
        "/v1/jobs", json=body, headers={"Authorization": f"Bearer {token or api.token}"}
    )
    assert r.status_code == 201, r.text
    job = str(r.json()["id"])
    for step in steps:
        folder = api.settings.runs_root / job / "checkpoints" / f"step-{step}"
        folder.mkdir(parents=True)
        (folder / "DONE").write_text("1\n")
    with api.services.engine.begin() as conn:
        conn.execute(
            update(JOBS)
            .where(JOBS.c.id == job)
            .values(status=status, ended_at=datetime.fromtimestamp(1_700_000_000, UTC))
        )
    return job


def test_models_lists_the_callers_finished_jobs_with_checkpoints(api: Api) -> None:
    done = _job(api, seq_len=40)
    _job(api, steps=())  # finished, no checkpoint: not a model
    running = _job(api, steps=(3,), status="running")
    theirs = _job(api, token=api.other_token)
    client = _sdk(api)
    cards = {m.id: m for m in client.models.list()}
    assert {done, f"{done}:2", f"{done}:4"} <= set(cards)
    assert running not in cards and theirs not in cards and f"{theirs}:2" not in cards
    card = cards[f"{done}:4"]
    assert card.object == "model" and card.owned_by == api.user
    assert card.created == 1_700_000_000
    assert card.model_extra and card.model_extra["max_model_len"] == 40
    assert client.models.retrieve(f"{done}:2").id == f"{done}:2"
    # A running job's checkpoint is a model /v1/completions accepts: retrievable.
    assert client.models.retrieve(running).root == running  # type: ignore[attr-defined]
    for missing in (theirs, f"{done}:3", "not-a-model"):
        with pytest.raises(openai.NotFoundError) as err:
            client.models.retrieve(missing)
        assert err.value.code == "model_not_found" and err.value.type == "not_found_error"


def test_bad_parameters_are_400s_naming_the_field_as_openai_does(api: Api) -> None:
    job = _job(api)
    client = _sdk(api)

    def bad(call: Any, **kwargs: Any) -> openai.BadRequestError:
        with pytest.raises(openai.BadRequestError) as err:
            call(model=job, **kwargs)
        assert err.value.status_code == 400 and err.value.type == "invalid_request_error"
        return err.value

    e = bad(client.completions.create, prompt="a", temperature=2.5)
    assert e.param == "temperature" and e.code == "invalid_value", e.body
    assert "temperature" in e.message
    e = bad(client.completions.create, prompt="a", logprobs=21)
    assert e.param == "logprobs"
    e = bad(client.completions.create, prompt="a", max_tokens=0)
    assert e.param == "max_tokens", "max_tokens 0 without echo asks for nothing"
    e = bad(client.completions.create, prompt="a", presence_penalty=2.5)
    assert e.param == "presence_penalty"
    e = bad(client.completions.create, prompt="a", logit_bias={"5": 101})
    assert e.param is not None and e.param.startswith("logit_bias"), e.param
    e = bad(client.completions.create, prompt=["a", ""])
    assert e.param == "prompt[1]" and "empty" in e.message
    e = bad(client.completions.create, prompt=["a"] * 65)
    assert e.param == "prompt"
    e = bad(client.completions.create, prompt="a", suffix="z")
    assert e.param == "suffix" and e.code == "unknown_parameter"
    e = bad(client.chat.completions.create, messages=[{"role": "robot", "content": "hi"}])
    assert e.param == "messages[0].role", e.param
    image = [{"type": "image_url", "image_url": {}}]
    e = bad(client.chat.completions.create, messages=[{"role": "user", "content": image}])
    assert e.param is not None and e.param.startswith("messages[0].content"), e.param
    e = bad(client.chat.completions.create, messages=[], top_logprobs=2)
    assert e.param == "messages"
    e = bad(client.chat.completions.create, messages=[{"role": "user", "content": "x"}],
            top_logprobs=2)  # fmt: skip
    assert e.param == "top_logprobs" and "logprobs" in e.message
    r = api.client.post("/v1/completions", content=b"\xff{",
                        headers={"Authorization": f"Bearer {api.token}",
                                 "Content-Type": "application/json"})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = api.client.post("/v1/completions", json={"prompt": "a"},
                        headers={"Authorization": f"Bearer {api.token}"})  # fmt: skip
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "model"
    assert err["code"] == "missing_required_parameter"


def test_auth_conflict_and_unavailable_in_openais_shape(api: Api) -> None:
    job = _job(api)
    with pytest.raises(openai.AuthenticationError) as auth:
        _sdk(api, "tq_nope").models.list()
    assert auth.value.code == "invalid_api_key" and auth.value.type == "authentication_error"
    client = _sdk(api)
    queued = _job(api, steps=(), status="queued")
    with pytest.raises(openai.ConflictError) as conflict:
        client.completions.create(model=queued, prompt="a")
    assert "no complete checkpoint" in conflict.value.message
    with pytest.raises(openai.InternalServerError) as down:  # no worker serves the queue
        client.completions.create(model=job, prompt="a")
    assert down.value.status_code == 503 and down.value.type == "server_error"
    assert down.value.code == "service_unavailable" and api.queue in down.value.message
    with pytest.raises(openai.NotFoundError) as other:
        _sdk(api, api.other_token).completions.create(model=job, prompt="a")
    assert other.value.code == "model_not_found" and job in other.value.message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model=f"{job}:3", messages=[{"role": "user", "content": "a"}]
        )


def test_the_rest_of_trainq_keeps_its_own_error_shape(api: Api) -> None:
    headers = {"Authorization": f"Bearer {api.token}"}
    job = _job(api)
    r = api.client.post(f"/v1/jobs/{job}/generate", json={"prompt": "a", "temperature": 9},
                        headers=headers)  # fmt: skip
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "temperature"]
    r = api.client.get("/v1/jobs/ffff", headers=headers)
    assert r.status_code == 404 and "detail" in r.json()
    assert is_openai_path("/v1/models/abc:3") and is_openai_path("/models/abc/tokenize")
    assert not is_openai_path("/v1/jobs/abc/generate") and not is_openai_path("/v1/modelsx")
    assert param_of(["body", "prompt", "list[int]", 3]) == "prompt[3]"
    assert param_of(["body", "messages", 0, "content", "str"]) == "messages[0].content"
    assert param_of(["body"]) is None


def test_a_fanned_out_call_takes_the_free_slots_up_to_its_prompts(api: Api) -> None:
    import redis.asyncio

    from service.api.generation.inflight import InFlight

    limit = api.settings.generate_max_per_owner
    owner = f"fan-{time.time_ns()}"

    async def run() -> None:
        aredis = redis.asyncio.Redis.from_url(api.settings.redis_url)
        inflight = InFlight(api.settings, aredis, api.settings.redis_prefix)
        one = await inflight.take(owner)
        taken, release = await inflight.take_up_to(owner, 64)
        assert taken == limit - 1 and await inflight.count(owner) == limit
        with pytest.raises(Exception) as full:
            await inflight.take_up_to(owner, 2)
        assert "TRAINQ_GENERATE_MAX_PER_OWNER" in str(full.value)
        await release()
        assert await inflight.count(owner) == 1
        small, again = await inflight.take_up_to(owner, 2)
        assert small == 2 and await inflight.count(owner) == 3
        await again()
        await one()
        assert await inflight.count(owner) == 0
        await aredis.aclose()

    asyncio.run(run())
