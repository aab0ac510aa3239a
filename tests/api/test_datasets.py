"""Datasets over the API: upload (text, jsonl, bin shards), checks as the bytes stream in,
preparation by a child process, ownership, limits, and what a job spec's dataset becomes.

The real app (TestClient) on PostgreSQL; preparation runs ``python -m
service.api.datasets.prepare`` as the API does. Each test has its own owners, so their
folders under the session's data root are their own.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from subprocess import PIPE
from typing import Any

import numpy as np
import pytest
from sqlalchemy import insert

from service.api.core.models import DATASETS, new_job_id, utcnow
from service.api.datasets.service import folder_of, owner_key, work_paths
from tests.api.support import Api
from trainer.data import TokenDataset, write_shard
from trainer.prepare import prepare

TEXT = "Hello, wörld! ñandú 🐍\n" * 400  # multi-byte characters, 10,400 bytes


def upload(api: Api, body: Any, token: str | None = None, **params: Any) -> Any:
    params.setdefault("name", "corpus")
    return api.client.post("/v1/datasets", params=params, content=body, headers=api.headers(token))


def wait_done(api: Api, name: str, token: str | None = None, timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        resp = api.client.get(f"/v1/datasets/{name}", headers=api.headers(token))
        assert resp.status_code == 200, resp.text
        found: dict[str, Any] = resp.json()
        if found["status"] not in ("uploading", "preparing"):
            return found
        assert time.monotonic() < deadline, f"dataset {name} still {found['status']}"
        time.sleep(0.1)


def ready(api: Api, body: Any, name: str = "corpus", **params: Any) -> dict[str, Any]:
    resp = upload(api, body, name=name, **params)
    assert resp.status_code == 202, resp.text
    assert resp.json()["status"] == "preparing"
    found = wait_done(api, name)
    assert found["status"] == "ready", found
    return found


def nothing_left(api: Api, name: str) -> None:
    """No row, no folder, no work file of this owner's dataset."""
    assert api.client.get(f"/v1/datasets/{name}", headers=api.headers()).status_code == 404
    root = Path(api.settings.data_root)
    assert not (root / folder_of(api.user, name)).exists()
    work = root / "datasets" / ".tmp"
    assert not work.exists() or list(work.iterdir()) == []


def shard_bytes(tokens: np.ndarray, tmp: Path) -> bytes:
    write_shard(tmp, tokens)
    return tmp.read_bytes()


def test_text_is_prepared_with_its_counts_and_seen_only_by_its_owner(api: Api) -> None:
    found = ready(api, TEXT.encode())
    raw = TEXT.encode()
    assert found["owner"] == api.user and found["format"] == "text"
    assert found["bytes"] == len(raw) and found["documents"] == 1
    assert found["vocab_size"] == 256 and found["tokenizer"] == "byte"
    assert found["train_tokens"] + found["val_tokens"] == len(raw)
    assert found["val_tokens"] == round(len(raw) * 0.1)
    assert found["path"] == f"datasets/{owner_key(api.user)}/corpus"
    folder = Path(api.settings.data_root) / found["path"]
    train = TokenDataset(folder, "train", seq_len=8)
    val = TokenDataset(folder, "val", seq_len=8)
    tokens = np.concatenate([*train.shards, *val.shards])
    assert bytes(tokens.astype(np.uint8)) == raw  # byte-level: the tokens are the bytes
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["out"] == found["path"] and meta["vocab_size"] == 256
    assert {p.stat().st_mode & 0o777 for p in folder.iterdir()} == {0o640}
    assert (folder.stat().st_mode & 0o777) == 0o750
    assert not list((folder.parent.parent / ".tmp").iterdir())  # work files are gone

    # Another token does not see it (404, as for jobs); an admin sees it in the list.
    other = api.client.get("/v1/datasets/corpus", headers=api.headers(api.other_token))
    assert other.status_code == 404
    assert api.client.get("/v1/datasets", headers=api.headers(api.other_token)).json() == {
        "items": []
    }
    peek = api.client.get(
        "/v1/datasets/corpus", params={"owner": api.user}, headers=api.headers(api.other_token)
    )
    assert peek.status_code == 404
    admin = api.client.get("/v1/datasets", headers=api.headers(api.admin_token)).json()
    assert found["id"] in {d["id"] for d in admin["items"]}
    as_admin = api.client.get(
        "/v1/datasets/corpus", params={"owner": api.user}, headers=api.headers(api.admin_token)
    )
    assert as_admin.json()["id"] == found["id"]
    # The same name again is a conflict; another owner may use it.
    assert upload(api, b"x").status_code == 409
    assert upload(api, b"mine", token=api.other_token).status_code == 202


def test_jsonl_records_become_documents(api: Api) -> None:
    texts = ["first record", "", "second\nrecord ✓", "third"]
    lines = [json.dumps({"text": t, "id": i}) for i, t in enumerate(texts)]
    body = ("\n".join(lines[:2]) + "\n\n" + "\n".join(lines[2:])).encode()  # a blank line
    found = ready(api, body, format="jsonl", val_fraction=0.0)
    want = "".join(t + "\n" for t in texts if t).encode()
    assert found["documents"] == 3 and found["val_tokens"] == 0
    assert found["train_tokens"] == len(want)
    folder = Path(api.settings.data_root) / found["path"]
    tokens = TokenDataset(folder, "train", seq_len=4).shards[0]
    assert bytes(np.asarray(tokens, dtype=np.uint8)) == want


def test_bin_shards_back_to_back_are_checked_and_resharded(api: Api, tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 300, 5000), rng.integers(0, 300, 3000)
    body = shard_bytes(a, tmp_path / "a.bin") + shard_bytes(b, tmp_path / "b.bin")
    found = ready(api, body, format="bin", vocab_size=300)
    assert found["documents"] == 2 and found["vocab_size"] == 300
    assert (found["train_tokens"], found["val_tokens"]) == (7200, 800)
    folder = Path(api.settings.data_root) / found["path"]
    val = TokenDataset(folder, "val", seq_len=8).shards[0]
    assert np.array_equal(val, b[-800:])  # upload order; the last tenth is val


CORRUPT = [
    (lambda s: s[:4] + b"\0\0\0\0" + s[8:], "expected 1 (uint16 tokens)"),  # version
    (lambda s: b"\x01" + s[1:], "magic"),
    (lambda s: s[:-3], "ends inside shard 2"),  # the header's count says more than there is
    (lambda s: s + b"\0\0", "ends inside shard 3"),  # trailing bytes: a partial header
]


def test_a_corrupt_shard_is_refused_and_leaves_nothing(api: Api, tmp_path: Path) -> None:
    one = shard_bytes(np.arange(100), tmp_path / "one.bin")
    for damage, said in CORRUPT:
        resp = upload(api, one + damage(one), format="bin")
        assert resp.status_code == 422, resp.text
        detail = resp.json()["detail"][0]
        assert detail["loc"] == ["body"] and said in detail["msg"], detail
        nothing_left(api, "corpus")
    resp = upload(api, shard_bytes(np.arange(300), tmp_path / "s.bin"), format="bin")
    assert resp.status_code == 422
    assert "token id 299, not below the vocab size 256" in resp.json()["detail"][0]["msg"]
    nothing_left(api, "corpus")


BAD_CORPORA = [
    ("text", b"", "the upload is empty"),
    ("jsonl", b'\n{"text": ""}\n\n', "holds no text"),
    ("jsonl", b'{"text": "a"}\n{"txt": "b"}\n', 'line 2 has no "text" string'),
    ("jsonl", b'{"text": "a"}\nnot json\n', "line 2 is not JSON"),
    ("bin", b"", "the upload is empty"),
    ("text", "abcñ".encode()[:-1], "byte 0xc3 at byte offset 3"),  # cut inside a character
]


def test_text_that_is_not_utf8_names_the_byte_offset_and_empty_corpora_are_refused(
    api: Api,
) -> None:
    body = ("ñ" * 1000).encode() + b"\xff rest"
    resp = upload(api, iter([body[:1001], body[1001:]]))  # a character split across chunks
    assert resp.status_code == 422
    assert "byte 0xff at byte offset 2000" in resp.json()["detail"][0]["msg"]
    nothing_left(api, "corpus")
    for fmt, bad, said in BAD_CORPORA:
        resp = upload(api, bad, format=fmt)
        assert resp.status_code == 422, resp.text
        assert said in resp.json()["detail"][0]["msg"], (fmt, resp.text)
        nothing_left(api, "corpus")


def test_an_upload_twice_the_limit_is_413_and_leaves_nothing(api: Api) -> None:
    api.settings.dataset_max_upload_bytes = 1 << 20
    body = b"a" * (2 << 20)
    sized = upload(api, body)  # Content-Length: refused before a byte is read
    assert sized.status_code == 413
    assert "TRAINQ_DATASET_MAX_UPLOAD_BYTES" in sized.json()["detail"]
    chunks = (body[i : i + 65536] for i in range(0, len(body), 65536))
    streamed = upload(api, chunks)  # chunked, no length: refused once it passes the limit
    assert streamed.status_code == 413 and str(1 << 20) in streamed.json()["detail"]
    nothing_left(api, "corpus")
    # The owner's total too: a first dataset counts against the second, as prepared (2 bytes
    # a token); the second, chunked, is refused once its bytes are in.
    api.settings.dataset_max_owner_bytes = 1 << 20
    first = ready(api, b"b" * 300_000, name="first")
    assert 600_000 < first["disk_bytes"] < 1 << 20
    over = upload(api, iter([b"c" * 300_000]), name="second")
    assert over.status_code == 413 and "TRAINQ_DATASET_MAX_OWNER_BYTES" in over.json()["detail"]
    nothing_left(api, "second")


def test_bad_names_and_tokenizers_are_422_naming_the_field(api: Api) -> None:
    for name in ["..", "a..b", ".hidden", "a/b", "x" * 65, "ü", "a\x00"]:
        resp = upload(api, b"text", name=name)
        assert resp.status_code == 422, name
        assert resp.json()["detail"][0]["loc"] == ["query", "name"]
    for bad in ("../etc", "/etc/passwd", "missing/tokenizer.json", "a\x00b"):
        resp = upload(api, b"text", tokenizer=bad)
        assert resp.status_code == 422, bad
        assert resp.json()["detail"][0]["loc"] == ["query", "tokenizer"]
    resp = upload(api, b"text", vocab_size=300)
    assert resp.json()["detail"][0]["loc"] == ["query", "vocab_size"]


@pytest.fixture()
def job_body(api: Api) -> Iterator[Any]:
    def build(data: dict[str, Any], vocab: int = 256) -> dict[str, Any]:
        model = {"n_layer": 1, "n_head": 1, "d_model": 8, "seq_len": 8, "vocab_size": vocab}
        return {"queue": api.queue, "train": {"steps": 1, "model": model, "data": data}}

    yield build


def test_submit_freezes_the_dataset_folder_and_delete_waits_for_the_job(
    api: Api, job_body: Any
) -> None:
    found = ready(api, TEXT.encode(), name="words")
    resp = api.client.post("/v1/jobs", json=job_body({"dataset": "words"}), headers=api.headers())
    assert resp.status_code == 201, resp.text
    job = resp.json()
    assert job["train"]["data"] == {"path": found["path"], "dataset": "words", "packing": False}
    refused = api.client.delete("/v1/datasets/words", headers=api.headers())
    assert refused.status_code == 409 and job["id"] in refused.json()["detail"]
    api.client.post(f"/v1/jobs/{job['id']}/cancel", headers=api.headers())
    assert api.client.delete("/v1/datasets/words", headers=api.headers()).status_code == 204
    assert not (Path(api.settings.data_root) / found["path"]).exists()
    assert api.client.get("/v1/datasets/words", headers=api.headers()).status_code == 404


def _row(api: Api, name: str, status: str, **values: Any) -> str:
    now = utcnow()
    row = {
        "id": new_job_id(),
        "owner": api.user,
        "name": name,
        "status": status,
        "format": "text",
        "tokenizer": "byte",
        "path": folder_of(api.user, name),
        "bytes": 10,
        "created_at": now,
        "updated_at": now,
        **values,
    }
    with api.services.sessions() as session, session.begin():
        session.execute(insert(DATASETS).values(**row))
    return str(row["id"])


def test_submit_with_an_unusable_dataset_is_422_naming_it(api: Api, job_body: Any) -> None:
    _row(api, "busy", "preparing")
    _row(api, "broken", "failed", reason="bad bytes")
    _row(api, "wide", "ready", vocab_size=50257, train_tokens=9, val_tokens=1)
    cases = [
        ({"dataset": "nope"}, 256, "dataset nope not found"),
        ({"dataset": "busy"}, 256, "dataset busy is preparing, not ready"),
        ({"dataset": "broken"}, 256, "dataset broken is failed (bad bytes), not ready"),
        ({"dataset": "wide"}, 256, "50257, larger than the model's 256 (train.model.gpt.vocab"),
        ({"dataset": "wide", "path": "tiny"}, 65536, "not both"),
    ]
    for data, vocab, said in cases:
        resp = api.client.post("/v1/jobs", json=job_body(data, vocab), headers=api.headers())
        assert resp.status_code == 422, (data, resp.text)
        detail = resp.json()["detail"][0]
        assert detail["loc"] == ["body", "train", "data", "dataset"], detail
        assert said in detail["msg"], detail
    wide = api.client.post(
        "/v1/jobs", json=job_body({"dataset": "wide"}, 50257), headers=api.headers()
    )
    assert wide.status_code == 201, wide.text
    # Another owner's dataset of that name is not found for this one.
    theirs = api.client.post(
        "/v1/jobs", json=job_body({"dataset": "wide"}, 50257), headers=api.headers(api.other_token)
    )
    assert theirs.status_code == 422 and "not found" in theirs.text


def test_a_dataset_whose_process_died_is_failed_by_the_reconciler(api: Api) -> None:
    stale = utcnow() - timedelta(seconds=api.settings.dataset_stale_s + 5)
    dead = _row(api, "dead", "preparing", updated_at=stale)
    alive = _row(api, "alive", "uploading")
    upload_file, out = work_paths(Path(api.settings.data_root), dead)
    out.mkdir(parents=True)
    upload_file.write_bytes(b"half")
    api.reconciler().run_once()
    gone = api.client.get("/v1/datasets/dead", headers=api.headers()).json()
    assert gone["status"] == "failed" and "stopped" in gone["reason"]
    assert not upload_file.exists() and not out.exists()
    fresh = api.client.get("/v1/datasets/alive", headers=api.headers()).json()
    assert fresh["status"] == "uploading" and alive
    # A failed dataset's name can be uploaded again (the failed one is replaced).
    assert ready(api, b"again", name="dead", val_fraction=0.0)["train_tokens"] == 5


def test_a_hugging_face_tokenizer_under_the_data_root_prepares_and_travels(
    api: Api, job_body: Any
) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]"])
    tok.train_from_iterator(["hello world the quick brown fox"] * 20, trainer)
    folder = Path(api.settings.data_root) / f"tok-{api.user}"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    text = "hello world the quick brown fox\n" * 50
    found = ready(api, text.encode(), name="bpe", tokenizer=folder.name)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    assert found["tokenizer"] == folder.name and found["vocab_size"] == vocab
    ids = tok.encode(text, add_special_tokens=False).ids
    assert found["train_tokens"] + found["val_tokens"] == len(ids)
    data = Path(api.settings.data_root) / found["path"]
    assert (data / "tokenizer.json").read_text() == (folder / "tokenizer.json").read_text()
    assert json.loads((data / "meta.json").read_text())["tokenizer"] == "tokenizer.json"
    small = api.client.post(
        "/v1/jobs", json=job_body({"dataset": "bpe"}, vocab - 1), headers=api.headers()
    )
    assert small.status_code == 422 and f"vocab size {vocab}" in small.text
    need = upload(api, b"", name="b", format="bin", tokenizer=folder.name)
    assert need.json()["detail"][0]["loc"] == ["query", "vocab_size"]


def _same_as_prepare(folder: Path, bare: Path, dataset_path: str) -> None:
    """Every shard byte for byte, and meta.json as prepare writes it (``out`` aside: the
    dataset's folder under the data root)."""
    names = sorted(p.name for p in folder.iterdir())
    assert names == sorted(p.name for p in bare.iterdir())
    for name in names:
        if name != "meta.json":
            assert (folder / name).read_bytes() == (bare / name).read_bytes(), name
    meta = {**json.loads((bare / "meta.json").read_text()), "out": dataset_path}
    assert (folder / "meta.json").read_text() == json.dumps(meta, indent=2) + "\n"


def test_byte_level_uploads_are_prepared_as_trainer_prepare_prepares_them(
    api: Api, tmp_path: Path
) -> None:
    """Byte-level text and jsonl are prepared while they arrive (the child follows the
    upload's file); the folder is what ``trainer.prepare`` makes of the same bytes."""
    raw = ("Hello, wörld! ñandú 🐍 " * 3000).encode()  # 81,000 bytes
    pieces = [raw[i : i + 10_007] for i in range(0, len(raw), 10_007)]  # split characters
    found = ready(api, iter(pieces), name="streamed", val_fraction=0.25)
    (tmp_path / "raw.txt").write_bytes(raw)
    prepare([tmp_path / "raw.txt"], tmp_path / "bare", val_fraction=0.25)
    folder = Path(api.settings.data_root) / found["path"]
    _same_as_prepare(folder, tmp_path / "bare", found["path"])

    texts = ["first ✓", "second\nrecord", "third"] * 100
    body = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()
    found = ready(api, body, name="lines", format="jsonl")
    (tmp_path / "texts.txt").write_text("".join(t + "\n" for t in texts), encoding="utf-8")
    prepare([tmp_path / "texts.txt"], tmp_path / "bare-lines")
    folder = Path(api.settings.data_root) / found["path"]
    _same_as_prepare(folder, tmp_path / "bare-lines", found["path"])


def _child(tmp_path: Path, env: dict[str, str], shard_tokens: int) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "service.api.datasets.prepare", "--format", "text"]
    argv += ["--src", str(tmp_path / "up"), "--out", str(tmp_path / "out")]
    argv += ["--dataset-path", "datasets/k/n", "--val-fraction", "0.3", "--wait-go"]
    argv += ["--shard-tokens", str(shard_tokens)]
    return subprocess.Popen(argv, env=env, stdin=PIPE, stdout=PIPE, stderr=PIPE)


def test_the_preparing_child_follows_a_growing_upload_into_several_shards(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """The child started with the upload: tokens appended as the file grows, at ``go`` the
    tail moved to val across shard boundaries; prepare's shards for the same options. Told
    anything else, it leaves nothing."""
    raw = ("añb 日本\n" * 40).encode()  # 480 bytes: 48 train shards of 7, then 21 val
    child = _child(tmp_path, subprocess_env, 7)
    with (tmp_path / "up").open("wb") as f:
        f.write(raw[:201])  # mid-character
        f.flush()
        time.sleep(0.5)  # the child reads this much before the rest comes
        f.write(raw[201:])
    out, err = child.communicate(b"go\n", timeout=60)
    result = json.loads(out.decode().splitlines()[-1])
    assert result["ok"] is True, err
    assert (result["train_shards"], result["val_shards"]) == (48, 21)
    prepare([tmp_path / "up"], tmp_path / "bare", val_fraction=0.3, shard_tokens=7)
    _same_as_prepare(tmp_path / "out", tmp_path / "bare", "datasets/k/n")

    shutil.rmtree(tmp_path / "out")
    (tmp_path / "up").unlink()
    child = _child(tmp_path, subprocess_env, 7)
    (tmp_path / "up").write_bytes(raw)
    time.sleep(0.5)
    out, err = child.communicate(b"stop\n", timeout=60)
    assert child.returncode == 0 and out == b"", err
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []
