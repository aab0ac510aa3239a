"""Bad input gets a clear 4xx naming the field; auth scopes jobs to their owner."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.api.support import Api


def _post(api: Api, body: Any, **kw: Any) -> Any:
    return api.client.post("/v1/jobs", json=body, headers=api.headers(), **kw)


def _locs(resp: Any) -> list[list[Any]]:
    assert resp.status_code == 422, resp.text
    return [e["loc"] for e in resp.json()["detail"]]


@pytest.mark.parametrize(
    ("body", "loc"),
    [
        ({"train": {"steps": 0}}, ["body", "train", "steps"]),
        ({"train": {"model": {"n_layer": "two"}}}, ["body", "train", "model", "gpt", "n_layer"]),
        ({"train": {"model": {"d_model": 64, "n_head": 3}}}, ["body", "train", "model", "gpt"]),
        ({"train": {"optim": {"lr": -1}}}, ["body", "train", "optim", "lr"]),
        ({"train": {}, "nodes": 10_000}, ["body", "nodes"]),
        ({"train": {}, "retries": -1}, ["body", "retries"]),
        ({"train": {}, "queue": "bad queue!"}, ["body", "queue"]),
        ({"train": {}, "labels": {"k": 1}}, ["body", "labels", "k"]),
        ({"train": {}, "colour": "red"}, ["body", "colour"]),  # unknown field
        ({"train": {"lr": 1}}, ["body", "train", "lr"]),  # unknown nested field
        ({}, ["body", "train"]),
        # PostgreSQL cannot store U+0000: refused at the edge, not a failed statement (503)
        ({"train": {}, "name": "a\x00b"}, ["body", "name"]),
        ({"train": {}, "labels": {"k": "v\x00"}}, ["body", "labels", "k"]),
        ({"train": {"data": {"path": "tiny\x00"}}}, ["body", "train", "data", "path"]),
        # A name or label cannot carry terminal escapes, CR/LF or bidi overrides.
        ({"train": {}, "name": "ok\x1b[31mred"}, ["body", "name"]),
        ({"train": {}, "name": "row\r\nforged  succeeded"}, ["body", "name"]),
        ({"train": {}, "name": "abc\u202edcba"}, ["body", "name"]),
        ({"train": {}, "labels": {"k": "v\x85"}}, ["body", "labels", "k"]),
        # Strict types: a spec is a contract, nothing is coerced.
        ({"train": {"steps": "5"}}, ["body", "train", "steps"]),
        ({"train": {"steps": True}}, ["body", "train", "steps"]),
        ({"train": {"steps": 5.0}}, ["body", "train", "steps"]),
        ({"train": {"compile": 1}}, ["body", "train", "compile"]),
        ({"train": {}, "retries": "1"}, ["body", "retries"]),
    ],
)
def test_invalid_spec_is_422_naming_the_field(api: Api, body: Any, loc: list[Any]) -> None:
    assert loc in _locs(_post(api, body))


def test_not_json_not_an_object_bad_yaml(api: Api) -> None:
    h = api.headers()
    assert _locs(api.client.post("/v1/jobs", content=b"{nope", headers=h)) == [["body"]]
    assert _locs(api.client.post("/v1/jobs", json=[1, 2], headers=h)) == [["body"]]
    yaml_h = {**h, "Content-Type": "application/yaml"}
    assert _locs(api.client.post("/v1/jobs", content=b"a: [1", headers=yaml_h)) == [["body"]]
    bomb = b"a: &a [x, x]\nb: &b [*a, *a]\ntrain: {}\n"
    resp = api.client.post("/v1/jobs", content=bomb, headers=yaml_h)
    assert resp.status_code == 422 and "alias" in resp.json()["detail"][0]["msg"]
    bad_key = {**h, "Idempotency-Key": "has space"}
    assert ["header", "idempotency-key"] in _locs(
        api.client.post("/v1/jobs", json={"train": {}}, headers=bad_key)
    )


@pytest.fixture()
def escape_link(data_root: Path, tmp_path: Path) -> Iterator[str]:
    outside = tmp_path / "secret"
    outside.mkdir()
    link = data_root / f"link-{os.getpid()}-{tmp_path.name}"
    link.symlink_to(outside, target_is_directory=True)
    yield link.name
    link.unlink()


def _yaml(api: Api, text: str) -> Any:
    h = {**api.headers(), "Content-Type": "application/yaml"}
    return api.client.post("/v1/jobs", content=text.encode(), headers=h)


@pytest.mark.parametrize("path", ["/v1/webhooks", "/v1/sweeps"])
def test_a_body_that_is_not_utf8_json_is_a_422_naming_the_body(api: Api, path: str) -> None:
    # Routes that take a model body: FastAPI's own answer would be an undocumented 400.
    headers = {**api.headers(), "content-type": "application/json"}
    resp = api.client.post(path, content=b"\xff\xfeG", headers=headers)
    assert _locs(resp) == [["body"]], resp.text
    assert resp.json()["detail"][0]["type"] == "json_invalid"
    assert api.client.get("/v1/nope", headers=api.headers()).json() == {"detail": "Not Found"}


def test_yaml_is_read_as_yaml_1_2_with_duplicate_keys_refused(api: Api) -> None:
    # YAML 1.1 read 1:20 as the base-60 integer 80; here it is a string, and refused.
    assert _locs(_yaml(api, f"queue: {api.queue}\ntrain:\n  steps: 1:20\n")) == [
        ["body", "train", "steps"]
    ]
    assert _locs(_yaml(api, "train:\n  compile: yes\n")) == [["body", "train", "compile"]]
    dup = _yaml(api, "train:\n  steps: 5\n  steps: 500\n")
    assert _locs(dup) == [["body"]] and "given twice" in dup.json()["detail"][0]["msg"]
    dup_json = api.client.post(
        "/v1/jobs",
        content=b'{"train": {"steps": 5, "steps": 500}}',
        headers={**api.headers(), "Content-Type": "application/json"},
    )
    assert _locs(dup_json) == [["body"]] and "given twice" in dup_json.json()["detail"][0]["msg"]
    # What YAML 1.2 reads as numbers still works: 1e-3 is a float, 0x10 an int.
    ok = _yaml(api, f"queue: {api.queue}\ntrain:\n  steps: 0x10\n  optim: {{lr: 1e-3}}\n")
    assert ok.status_code == 201, ok.text
    assert ok.json()["train"]["steps"] == 16 and ok.json()["train"]["optim"]["lr"] == 0.001


def test_deep_nesting_is_a_4xx_not_a_500(api: Api, caplog: pytest.LogCaptureFixture) -> None:
    h = {**api.headers(), "Content-Type": "application/json"}
    deep_json = b'{"train": ' + b"[" * 990 + b"]" * 990 + b"}"
    resp = api.client.post("/v1/jobs", content=deep_json, headers=h)
    assert _locs(resp) == [["body"]] and "nested deeper" in resp.json()["detail"][0]["msg"]
    deep_yaml = "train: " + "[" * 500 + "]" * 500 + "\n"
    resp = _yaml(api, deep_yaml)
    assert _locs(resp) == [["body"]] and "nested deeper" in resp.json()["detail"][0]["msg"]
    assert "Traceback" not in caplog.text and "RecursionError" not in caplog.text


def test_a_yaml_body_has_its_own_smaller_limit(api: Api) -> None:
    limit = api.settings.max_yaml_bytes
    big = "train: {}\n" + "".join(f"# {'x' * 70}\n" for _ in range(limit // 70 + 1))
    resp = _yaml(api, big)
    assert resp.status_code == 413 and str(limit) in resp.json()["detail"], resp.text
    # The same spec as JSON is under the JSON limit: accepted.
    assert (
        _post(api, {"queue": api.queue, "train": {}, "labels": {"pad": "x" * 200}}).status_code
        == 201
    )


def test_data_paths_stay_inside_the_data_root(api: Api, escape_link: str) -> None:
    for path in ["../etc", "tiny/../../x", "/etc/passwd", escape_link]:
        resp = _post(api, {"train": {"data": {"path": path}}})
        assert _locs(resp) == [["body", "train", "data", "path"]], path
    assert _post(api, {"queue": api.queue, "train": {"data": {"path": "tiny"}}}).status_code == 201


def test_body_over_the_limit_is_413(api: Api) -> None:
    big = b'{"name": "' + b"x" * (1024 * 1024 + 10) + b'"}'
    resp = api.client.post("/v1/jobs", content=big, headers=api.headers())
    assert resp.status_code == 413 and "larger than" in resp.json()["detail"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it streams
        yield b'{"name": "'
        for _ in range(20):
            yield b"y" * 65536
        yield b'"}'

    streamed = api.client.post("/v1/jobs", content=chunks(), headers=api.headers())
    assert streamed.status_code == 413
    # On the OpenAI routes, in OpenAI's shape either way (its SDK reads error.message).
    for path in ["/v1/chat/completions", "/models/ab/v1/completions"]:
        for content in (big, chunks()):
            resp = api.client.post(path, content=content, headers=api.headers())
            error = resp.json()["error"]
            assert resp.status_code == 413 and "larger than" in error["message"], path
            assert error["code"] == "request_too_large"


def test_bad_query_parameters(api: Api) -> None:
    h = api.headers()
    assert _locs(api.client.get("/v1/jobs", params={"limit": 0}, headers=h)) == [["query", "limit"]]
    assert _locs(api.client.get("/v1/jobs", params={"cursor": "!!"}, headers=h)) == [
        ["query", "cursor"]
    ]
    assert _locs(api.client.get("/v1/jobs", params={"label": "nocolon"}, headers=h)) == [
        ["query", "label"]
    ]
    assert _locs(api.client.get("/v1/jobs", params={"status": "done"}, headers=h)) == [
        ["query", "status"]
    ]
    assert api.client.get("/v1/jobs/NOT-HEX", headers=h).status_code == 422
    assert api.client.get("/v1/jobs/abc123", headers=h).status_code == 404
    for param in ({"name": "a\x00"}, {"label": "k:v\x00"}):
        key = next(iter(param))
        assert _locs(api.client.get("/v1/jobs", params=param, headers=h)) == [["query", key]]


def test_auth_required_and_scoped(api: Api) -> None:
    job = api.submit()
    assert api.client.get(f"/v1/jobs/{job['id']}").status_code == 401
    unknown = api.client.get(f"/v1/jobs/{job['id']}", headers={"Authorization": "Bearer tq_nope"})
    assert unknown.status_code == 401 and unknown.headers["www-authenticate"] == "Bearer"
    basic = api.client.get("/v1/jobs", headers={"Authorization": "Basic eDp5"})
    assert basic.status_code == 401
    # Another owner's job does not exist for them; their list does not show it.
    other = api.headers(api.other_token)
    assert api.client.get(f"/v1/jobs/{job['id']}", headers=other).status_code == 404
    assert api.client.get(f"/v1/jobs/{job['id']}/metrics", headers=other).status_code == 404
    assert api.client.get(f"/v1/jobs/{job['id']}/logs", headers=other).status_code == 404
    assert api.client.get(f"/v1/jobs/{job['id']}/events", headers=other).status_code == 404
    assert job["id"] not in [
        i["id"] for i in api.client.get("/v1/jobs", headers=other).json()["items"]
    ]
    # The admin sees it.
    admin = api.headers(api.admin_token)
    assert api.client.get(f"/v1/jobs/{job['id']}", headers=admin).json()["owner"] == api.user
    listed = api.client.get("/v1/jobs", params={"limit": 500}, headers=admin).json()["items"]
    assert job["id"] in [i["id"] for i in listed]


def test_revoked_token_stops_working(api: Api, make_settings: Any) -> None:
    from fastapi.testclient import TestClient

    from service.api.app import create_app
    from service.api.core.auth import create_token, revoke_tokens

    app = create_app(make_settings(token_cache_s=0))
    s = app.state.services
    with s.sessions() as session, session.begin():
        token = create_token(session, "carol-revoked")
    with TestClient(app) as client:
        h = {"Authorization": f"Bearer {token}"}
        assert client.get("/v1/jobs", headers=h).status_code == 200
        with s.sessions() as session, session.begin():
            assert revoke_tokens(session, name="carol-revoked") == 1
        assert client.get("/v1/jobs", headers=h).status_code == 401


def test_auth_off_only_when_said_so(make_settings: Any) -> None:
    from fastapi.testclient import TestClient

    from service.api.app import create_app

    assert make_settings(auth="typo").auth_enabled
    assert make_settings(auth="OFF").auth_enabled is False
    with TestClient(create_app(make_settings(auth="off"))) as client:
        resp = client.get("/v1/jobs")
        assert resp.status_code == 200


def test_random_tokens_cannot_flush_a_known_one_from_the_cache(api: Api) -> None:
    from service.api.core.auth import TokenCache
    from service.api.core.errors import Unauthorized

    cache = TokenCache(api.services.reader.connect, ttl_s=60, max_entries=50)
    known = f"Bearer {api.token}"
    assert cache.resolve(known).name == api.user
    for i in range(200):  # four times what the cache holds
        with pytest.raises(Unauthorized):
            cache.resolve(f"Bearer tq_random{i:04d}")
    # Still answered from memory: resolve_cached never touches the database.
    assert cache.resolve_cached(known).name == api.user
    with pytest.raises(Unauthorized):  # the newest unknown ones are remembered too
        cache.resolve_cached("Bearer tq_random0199")
    with pytest.raises(LookupError):  # the oldest were evicted, one at a time
        cache.resolve_cached("Bearer tq_random0000")
