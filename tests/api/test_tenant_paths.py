"""A tenant's data is theirs alone (issue 22): every path a spec or an upload names resolves
by the one rule of ``trainer.paths``, and what uses a dataset or a job is counted by identity.

Two tenants on the real app (PostgreSQL, Redis, the preparing child): alice (``api.token``)
uploads a corpus holding a secret; bob (``api.other_token``) tries every path field with her
folder, its ``..`` / ``/.`` / ``//`` / absolute spellings, and links to it placed in the
shared area. Each try is a 422 naming the field, with no absolute path and no file content.
"""

from __future__ import annotations

import base64
import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import insert, update

from service.api.core.models import JOBS, new_job_id, utcnow
from service.api.scheduling.retention import delete_jobs
from tests.api.support import Api
from tests.api.test_datasets import ready, upload, wait_done
from tests.api.test_submit import _broker
from trainer.config import frozen_data_path
from trainer.paths import owner_key
from worker.message import JobMessage

SECRET = "ALICE-SECRET-KEY=hunter2\n" * 200
TINY = {"n_layer": 1, "n_head": 1, "d_model": 8, "seq_len": 8, "vocab_size": 256}


@pytest.fixture()
def alice(api: Api) -> Iterator[dict[str, Any]]:
    """Alice's ready dataset ``corp``, and links to its folder (and to outside the root)
    placed in the shared area, as a careless operator or an old bug might leave them."""
    found = ready(api, SECRET.encode(), name="corp", val_fraction=0.1)
    root = Path(api.settings.data_root)
    tag = uuid.uuid4().hex[:8]
    links = {
        f"link-{tag}": root / found["path"],
        f"shared-{tag}": root / "datasets",
        f"out-{tag}": root.parent,
    }
    for name, target in links.items():
        (root / name).symlink_to(target, target_is_directory=True)
    yield {**found, "links": list(links)}
    for name in links:
        (root / name).unlink()


def spellings(api: Api, found: dict[str, Any]) -> list[str]:
    folder = found["path"]  # datasets/<alice's key>/corp
    root = Path(api.settings.data_root)
    link, shared, out = found["links"]
    return [
        folder,
        f"{folder}/.",
        f"{folder}/",
        f"./{folder}",
        f"tiny/../{folder}",
        folder.replace("/", "//", 1),
        str(root / folder),  # absolute
        link,  # a link to her folder
        f"{shared}/{owner_key(api.user)}/corp",  # a link to datasets/
        f"{out}/{root.name}/{folder}",  # a link out of the root, and back in
    ]


def _message(raw: dict[str, Any]) -> JobMessage:
    args, _kwargs, _embed = json.loads(base64.b64decode(raw["body"]))
    return JobMessage.from_json(args[0])


def job(queue: str, **train: Any) -> dict[str, Any]:
    return {"queue": queue, "train": {"steps": 1, "model": TINY, **train}}


def refused(resp: Any, api: Api, loc: list[str], field: str) -> str:
    """A 422 at ``loc`` whose message names ``field``, says no absolute path and no secret."""
    assert resp.status_code == 422, resp.text
    detail = resp.json()["detail"]
    assert [d["loc"] for d in detail] == [loc], detail
    msg = str(detail[0]["msg"])
    assert field in msg, msg
    assert str(Path(api.settings.data_root)) not in resp.text
    assert "ALICE-SECRET" not in resp.text and "line" not in msg
    return msg


def test_every_path_field_refuses_another_owners_folder_however_spelled(
    api: Api, alice: dict[str, Any]
) -> None:
    bob = api.headers(api.other_token)
    hf = {"family": "hf", "seq_len": 8}
    for path in spellings(api, alice):
        for dry in ("true", "false"):
            bodies = [
                (job(api.queue, data={"path": path}), ["data", "path"], "train.data.path"),
                (job(api.queue, init={"path": path}), ["init", "path"], "train.init.path"),
                (
                    {"queue": api.queue, "train": {"steps": 1, "model": {**hf, "path": path}}},
                    ["model", "hf", "path"],
                    "train.model.path",
                ),
            ]
            for body, loc, field in bodies:
                resp = api.client.post("/v1/jobs", json=body, params={"dry_run": dry}, headers=bob)
                refused(resp, api, ["body", "train", *loc], field)
        resp = upload(api, b"hello", token=api.other_token, name="stolen", tokenizer=path)
        refused(resp, api, ["query", "tokenizer"], "tokenizer")
        # a file inside her folder, as the old oracle used it
        resp = upload(api, b"x", token=api.other_token, name="s2", tokenizer=f"{path}/meta.json")
        assert resp.status_code == 422, resp.text
        assert str(Path(api.settings.data_root)) not in resp.text
    # Nothing of bob's was stored, and her dataset is untouched.
    assert api.client.get("/v1/jobs", headers=bob).json()["items"] == []
    assert api.client.get("/v1/datasets", headers=bob).json()["items"] == []
    assert api.client.get("/v1/datasets/corp", headers=api.headers()).json()["status"] == "ready"


def test_the_owner_reaches_her_upload_only_by_name_and_the_error_says_so(
    api: Api, alice: dict[str, Any]
) -> None:
    mine = api.headers()
    by_path = api.client.post("/v1/jobs", json=job(api.queue, data={"path": alice["path"]}),
                              headers=mine)  # fmt: skip
    msg = refused(by_path, api, ["body", "train", "data", "path"], "train.data.path")
    assert "train.data.dataset" in msg  # what to use instead
    by_name = api.client.post("/v1/jobs", json=job(api.queue, data={"dataset": "corp"}),
                              headers=mine)  # fmt: skip
    assert by_name.status_code == 201, by_name.text
    assert by_name.json()["train"]["data"] == {"dataset": "corp", "path": alice["path"],
                                               "packing": False}  # fmt: skip
    # the worker's message names the owner, so the worker can check the frozen folder's key
    sent = [_message(m) for m in _broker(api)]
    assert [(m.job_id, m.owner) for m in sent] == [(by_name.json()["id"], api.user)]
    frozen = frozen_data_path(sent[0].train, api.settings.data_root, sent[0].owner)
    assert frozen == Path(api.settings.data_root).resolve() / alice["path"]
    # bob's data.dataset names his own namespace: hers is not found for him
    theirs = api.client.post("/v1/jobs", json=job(api.queue, data={"dataset": "corp"}),
                             headers=api.headers(api.other_token))  # fmt: skip
    assert theirs.status_code == 422 and "not found (or not yours)" in theirs.text
    # The shared area stays nameable, as it was.
    shared = api.client.post("/v1/jobs", json=job(api.queue, data={"path": "tiny"}),
                             params={"dry_run": "true"}, headers=mine)  # fmt: skip
    assert shared.status_code == 200, shared.text


def test_a_link_in_the_shared_area_is_refused_wherever_it_points(api: Api, tmp_path: Path) -> None:
    root = Path(api.settings.data_root)
    real = root / f"real-{tmp_path.name}"
    real.mkdir()
    inner = root / f"inner-{tmp_path.name}"
    inner.symlink_to(real, target_is_directory=True)  # even a link to the shared area
    try:
        for path in (inner.name, f"{inner.name}/sub"):
            resp = api.client.post("/v1/jobs", json=job(api.queue, data={"path": path}),
                                   headers=api.headers())  # fmt: skip
            msg = refused(resp, api, ["body", "train", "data", "path"], "train.data.path")
            assert f"{inner.name} is a symbolic link" in msg
    finally:
        inner.unlink()


def test_bob_cannot_pin_alices_dataset_and_her_409_names_only_her_jobs(
    api: Api, alice: dict[str, Any]
) -> None:
    # A job row as an older server stored it: bob's, on a queue nobody serves, naming her
    # folder by path. It is not hers and names no data.dataset: it pins nothing.
    legacy = new_job_id()
    with api.services.sessions() as session, session.begin():
        session.execute(
            insert(JOBS).values(
                id=legacy,
                owner="bob-legacy",
                name="pin",
                queue="nobody-serves-this",
                labels={},
                nodes=1,
                procs_per_node=1,
                retries=0,
                train={"data": {"path": alice["path"]}},
                spec_hash="x",
                status="queued",
                attempt=1,
                created_at=utcnow(),
            )
        )
    mine = api.headers()
    ok = api.client.post("/v1/jobs", json=job(api.queue, data={"dataset": "corp"}), headers=mine)
    assert ok.status_code == 201, ok.text
    busy = api.client.delete("/v1/datasets/corp", headers=mine)
    assert busy.status_code == 409 and ok.json()["id"] in busy.text
    assert legacy not in busy.text
    api.client.post(f"/v1/jobs/{ok.json()['id']}/cancel", headers=mine)
    assert api.client.delete("/v1/datasets/corp", headers=mine).status_code == 204


def _finished(api: Api, token: str | None = None) -> str:
    """A job of the token's owner, ended (cancelled while queued)."""
    h = api.headers(token)
    made = api.client.post("/v1/jobs", json=job(api.queue, data={"path": "tiny"}), headers=h)
    assert made.status_code == 201, made.text
    job_id = str(made.json()["id"])
    assert api.client.post(f"/v1/jobs/{job_id}/cancel", headers=h).json()["status"] == "cancelled"
    return job_id


def test_a_job_that_a_queued_job_starts_from_is_not_deleted(api: Api) -> None:
    base = _finished(api)
    mine, bob, admin = api.headers(), api.headers(api.other_token), api.headers(api.admin_token)
    # bob may not start from alice's job (its weights are hers): 422, as if it did not exist
    theirs = api.client.post("/v1/jobs", json=job(api.queue, init={"job": base}), headers=bob)
    assert theirs.status_code == 422, theirs.text
    assert theirs.json()["detail"][0]["loc"] == ["body", "train", "init", "job"]
    assert "not found (or not yours)" in theirs.text
    child = api.client.post("/v1/jobs", json=job(api.queue, init={"job": base}), headers=mine)
    assert child.status_code == 201, child.text
    by_admin = api.client.post("/v1/jobs", json=job(api.queue, init={"job": base}), headers=admin)
    assert by_admin.status_code == 201, by_admin.text
    held = api.client.delete(f"/v1/jobs/{base}", headers=mine)
    assert held.status_code == 409, held.text
    said = held.json()["detail"]
    assert child.json()["id"] in said and "1 job(s) of other owners" in said
    assert by_admin.json()["id"] not in said  # another owner's job id is never shown
    # the retention pass leaves it too
    runs = api.settings.runs_root
    assert delete_jobs(api.services.sessions, [base], runs, False) == 0
    assert api.client.get(f"/v1/jobs/{base}", headers=mine).status_code == 200
    for started, h in ((child, mine), (by_admin, admin)):
        api.client.post(f"/v1/jobs/{started.json()['id']}/cancel", headers=h)
    assert api.client.delete(f"/v1/jobs/{base}", headers=mine).status_code == 204


def test_a_finished_job_that_names_it_does_not_hold_it(api: Api) -> None:
    base = _finished(api)
    child = api.client.post("/v1/jobs", json=job(api.queue, init={"job": base}),
                            headers=api.headers())  # fmt: skip
    assert child.status_code == 201, child.text
    with api.services.sessions() as session, session.begin():  # it ran and ended
        session.execute(
            update(JOBS).where(JOBS.c.id == child.json()["id"]).values(status="succeeded")
        )
    assert api.client.delete(f"/v1/jobs/{base}", headers=api.headers()).status_code == 204


def test_hand_made_paths_keep_working_in_the_shared_area(api: Api) -> None:
    root = Path(api.settings.data_root)
    nested = root / f"team-{os.getpid()}" / "corpora" / "web"
    nested.mkdir(parents=True)
    rel = nested.relative_to(root).as_posix()
    resp = api.client.post("/v1/jobs", json=job(api.queue, data={"path": rel}),
                           params={"dry_run": "true"}, headers=api.headers())  # fmt: skip
    assert resp.status_code == 200, resp.text


def test_a_tokenizer_that_does_not_load_says_so_without_quoting_it(api: Api) -> None:
    """``?tokenizer=`` was an oracle: the parser's error quoted the file. Now the reason
    names the tokenizer as the tenant did, and says only that it does not load."""
    root = Path(api.settings.data_root)
    folder = root / f"badtok-{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    (folder / "tokenizer.json").write_text('{"version": "1.0",\n  "model": ALICE-SECRET}')
    resp = upload(api, b"hello world\n" * 50, name="bad", tokenizer=folder.name)
    assert resp.status_code == 202, resp.text
    found = wait_done(api, "bad")
    assert found["status"] == "failed", found
    reason = str(found["reason"])
    assert "cannot be loaded as a Hugging Face tokenizer.json" in reason, reason
    for leak in (str(root), "ALICE", "line 2", "column"):
        assert leak not in reason, reason
