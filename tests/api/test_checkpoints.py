"""Checkpoints over HTTP: listing and tar downloads of a run folder a real trainer run wrote.

One short run (python -m trainer, one process, 4 steps, a checkpoint every 2, the Hugging
Face folder at the end) is made for the module; each test copies it under its app's runs
root as the run folder of a job it submitted, and feeds the run's metrics.jsonl to the
ingestor the way a worker would, so the listing's losses come from SQL.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from service.api.checkpoints.files import DONE, checkpoints_dir, open_format
from service.api.checkpoints.tar import MAX_OPEN, Archive
from service.cli import main as cli
from tests.api.support import Api, Uvicorn, WorkerSim
from tests.trainer import runs

pytestmark = pytest.mark.timeout(120)

STEPS = 4
CONFIG = runs.config(
    steps=STEPS,
    batch={"micro_batch_size": 4},
    eval={"every": 2, "steps": 1},
    checkpoint={"every": 2, "keep": 2, "hf": "final"},
)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, subprocess_env: dict[str, str]) -> Path:
    root = tmp_path_factory.mktemp("ckpt-run")
    runs.write_corpus(root / "data")
    # Started with umask 0: the Hugging Face folder is still 0750 with 0640 files.
    code, out = runs.run(CONFIG, root / "run", root / "data", subprocess_env, nproc=1, umask=0)
    assert code == 0, out
    assert "hf: wrote" in out, out
    assert "checkpoints/step-4/hf/model.safetensors" in runs.modes(root / "run")
    assert runs.wrong_modes(root / "run") == {}
    return root / "run"


@pytest.fixture(scope="module")
def lora_trained(tmp_path_factory: pytest.TempPathFactory, subprocess_env: dict[str, str]) -> Path:
    """A LoRA run of the debug GPT (2 steps): its last checkpoint has hf/ and peft/."""
    root = tmp_path_factory.mktemp("lora-run")
    runs.write_corpus(root / "data")
    cfg = runs.config(steps=2, eval={"every": 0}, checkpoint={"every": 0, "keep": 1, "hf": "final"})
    cfg["lora"] = {"rank": 2, "alpha": 4.0}
    code, out = runs.run(cfg, root / "run", root / "data", subprocess_env, nproc=1)
    assert code == 0 and "peft: wrote" in out, out
    return root / "run"


def _job_with_run(api: Api, sim: Callable[..., WorkerSim], trained: Path) -> str:
    """A submitted job whose run folder is ``trained``, its metrics ingested."""
    job_id = str(api.submit()["id"])
    shutil.copytree(trained, api.settings.runs_root / job_id, symlinks=True)
    wire = sim(job_id)
    wire.claim()
    wire.running()
    for record in runs.metrics(trained):
        wire.event("metric", "trainer", record)
    api.drain()
    return job_id


def _files(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _members(body: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(body), mode="r:") as tar:
        return {
            m.name: tar.extractfile(m).read()  # type: ignore[union-attr]
            for m in tar.getmembers()
            if m.isfile()
        }


def test_lists_complete_checkpoints_with_losses_sizes_and_formats(
    api: Api, sim: Callable[..., WorkerSim], trained: Path
) -> None:
    job_id = _job_with_run(api, sim, trained)
    ck = api.settings.runs_root / job_id / "checkpoints"
    (ck / "step-6").mkdir()  # renamed but no DONE yet: not a checkpoint
    (ck / "tmp-step-8").mkdir()
    resp = api.client.get(f"/v1/jobs/{job_id}/checkpoints", headers=api.headers())
    assert resp.status_code == 200, resp.text
    items = resp.json()["items"]
    assert [c["step"] for c in items] == [2, 4]
    metrics = {m["step"]: m for m in runs.metrics(trained)}
    for c in items:
        folder = ck / f"step-{c['step']}"
        meta = json.loads((folder / "meta.json").read_text())
        assert c["tokens_seen"] == meta["tokens_seen"] == c["step"] * 4 * 32
        assert c["loss"] == pytest.approx(metrics[c["step"]]["loss"])
        assert c["val_loss"] == pytest.approx(metrics[c["step"]]["val_loss"])
        assert c["strategy"] == "single" and c["world_size"] == 1
        native = {k: v for k, v in _files(folder).items() if not k.startswith("hf/")}
        assert c["size_bytes"] == sum(len(v) for v in native.values())
        assert c["time"] is not None
    assert [c["latest"] for c in items] == [False, True]
    assert items[0]["formats"] == ["native"] and items[0]["hf_size_bytes"] is None
    assert items[1]["formats"] == ["native", "hf"]
    hf = _files(ck / "step-4" / "hf")
    assert {"config.json", "model.safetensors"} <= set(hf)
    assert items[1]["hf_size_bytes"] == sum(len(v) for v in hf.values())


def test_download_is_the_files_as_a_deterministic_tar(
    api: Api, sim: Callable[..., WorkerSim], trained: Path, tmp_path: Path
) -> None:
    job_id = _job_with_run(api, sim, trained)
    folder = api.settings.runs_root / job_id / "checkpoints" / "step-4"
    url = f"/v1/jobs/{job_id}/checkpoints/latest/download"
    hf = api.client.get(url, params={"format": "hf"}, headers=api.headers())
    assert hf.status_code == 200, hf.text
    assert hf.headers["x-trainq-step"] == "4"
    assert hf.headers["content-type"] == "application/x-tar"
    assert int(hf.headers["content-length"]) == len(hf.content)
    assert _members(hf.content) == _files(folder / "hf")
    again = api.client.get(
        f"/v1/jobs/{job_id}/checkpoints/4/download?format=hf", headers=api.headers()
    )
    assert again.content == hf.content and again.headers["etag"] == hf.headers["etag"]

    native = api.client.get(url, headers=api.headers())  # format=native is the default
    assert native.status_code == 200, native.text
    expected = {k: v for k, v in _files(folder).items() if not k.startswith("hf/")}
    assert _members(native.content) == expected
    assert DONE in expected and "meta.json" in expected and "model.pt" in expected
    with tarfile.open(fileobj=io.BytesIO(native.content), mode="r:") as tar:
        tar.extractall(tmp_path / "native", filter="data")  # what `trainq download` does
    assert _files(tmp_path / "native") == expected


def test_range_resumes_and_if_range_guards_it(
    api: Api, sim: Callable[..., WorkerSim], trained: Path
) -> None:
    job_id = _job_with_run(api, sim, trained)
    url = f"/v1/jobs/{job_id}/checkpoints/4/download"
    full = api.client.get(url, headers=api.headers())
    size, etag = len(full.content), full.headers["etag"]
    assert full.headers["accept-ranges"] == "bytes"
    head = api.client.get(url, headers={**api.headers(), "Range": "bytes=0-999"})
    assert head.status_code == 206 and head.headers["content-range"] == f"bytes 0-999/{size}"
    tail = api.client.get(url, headers={**api.headers(), "Range": "bytes=1000-", "If-Range": etag})
    assert tail.status_code == 206 and int(tail.headers["content-length"]) == size - 1000
    assert head.content + tail.content == full.content
    last = api.client.get(url, headers={**api.headers(), "Range": "bytes=-700"})
    assert last.status_code == 206 and last.content == full.content[-700:]
    stale = api.client.get(
        url, headers={**api.headers(), "Range": "bytes=1000-", "If-Range": '"other"'}
    )
    assert stale.status_code == 200 and stale.content == full.content
    past = api.client.get(url, headers={**api.headers(), "Range": f"bytes={size}-"})
    assert past.status_code == 416 and past.headers["content-range"] == f"bytes */{size}"


def test_head_answers_what_get_would_without_a_body(
    api: Api, sim: Callable[..., WorkerSim], trained: Path
) -> None:
    job_id = _job_with_run(api, sim, trained)
    url = f"/v1/jobs/{job_id}/checkpoints/latest/download"
    with Uvicorn(api.app) as server, httpx.Client(base_url=server.url) as client:
        for params in ({}, {"format": "hf"}):
            full = client.get(url, params=params, headers=api.headers())
            head = client.head(url, params=params, headers=api.headers())
            assert head.status_code == 200 and head.content == b"", head.status_code
            for name in ("content-length", "etag", "accept-ranges", "x-trainq-step",
                         "content-type", "content-disposition"):  # fmt: skip
                assert head.headers[name] == full.headers[name], name
            assert int(head.headers["content-length"]) == len(full.content)
        # A range, as GET would answer it; and the same errors as GET.
        ranged = client.head(url, headers={**api.headers(), "Range": "bytes=0-99"})
        assert ranged.status_code == 206 and ranged.headers["content-length"] == "100"
        assert ranged.headers["content-range"].startswith("bytes 0-99/")
        missing = client.head(f"/v1/jobs/{job_id}/checkpoints/7/download", headers=api.headers())
        assert missing.status_code == 404 and missing.content == b""
        assert client.head(url).status_code == 401
        # The server goes on serving (the archive HEAD opened was closed).
        assert client.get(url, headers=api.headers()).status_code == 200


def test_bad_input_ownership_and_missing_checkpoints(
    api: Api, sim: Callable[..., WorkerSim], trained: Path
) -> None:
    job_id = _job_with_run(api, sim, trained)
    base = f"/v1/jobs/{job_id}/checkpoints"

    def get(path: str, token: str | None = None, **params: Any) -> httpx.Response:
        return api.client.get(path, params=params, headers=api.headers(token))

    for token in (api.other_token,):  # another owner's job is not found, whatever the path
        assert get(base, token).status_code == 404
        assert get(f"{base}/4/download", token).status_code == 404
    assert get(base, api.admin_token).status_code == 200
    assert get("/v1/jobs/00000000deadbeef/checkpoints").status_code == 404
    missing = get(f"{base}/3/download")
    assert missing.status_code == 404 and "step 3" in missing.json()["detail"]
    no_hf = get(f"{base}/2/download", format="hf")
    assert no_hf.status_code == 409 and "format=native" in no_hf.json()["detail"]
    for step in ("abc", "-1", "12345678901", "..%2F..%2Fetc"):
        bad = get(f"{base}/{step}/download")
        assert bad.status_code in (404, 422), (step, bad.text)
        assert bad.status_code != 500
    assert get(f"{base}/abc/download").json()["detail"][0]["loc"] == ["path", "step"]
    bad_format = get(f"{base}/4/download", format="zip")
    assert bad_format.status_code == 422 and bad_format.json()["detail"][0]["loc"] == [
        "query",
        "format",
    ]
    assert get("/v1/jobs/NOT-HEX/checkpoints").status_code == 422

    fresh = str(api.submit()["id"])  # queued: no run folder yet
    listed = get(f"/v1/jobs/{fresh}/checkpoints")
    assert listed.status_code == 200 and listed.json()["items"] == []
    assert get(f"/v1/jobs/{fresh}/checkpoints/latest/download").status_code == 404


def test_links_and_special_files_are_never_served(
    api: Api, sim: Callable[..., WorkerSim], trained: Path, tmp_path: Path
) -> None:
    job_id = _job_with_run(api, sim, trained)
    ck = api.settings.runs_root / job_id / "checkpoints"
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "key").write_text("do not serve")
    (secret / DONE).write_text("1\n")
    (ck / "step-4" / "stolen").symlink_to(secret / "key")
    (ck / "step-4" / "dcp").symlink_to(secret)
    os.mkfifo(ck / "step-4" / "pipe")
    (ck / "step-9").symlink_to(secret)  # a "checkpoint" that is a link out
    listed = api.client.get(f"/v1/jobs/{job_id}/checkpoints", headers=api.headers()).json()
    assert [c["step"] for c in listed["items"]] == [2, 4]
    body = api.client.get(
        f"/v1/jobs/{job_id}/checkpoints/4/download", headers=api.headers()
    ).content
    with tarfile.open(fileobj=io.BytesIO(body), mode="r:") as tar:
        names = tar.getnames()
    assert not {"stolen", "dcp", "pipe"} & set(names) and "meta.json" in names
    assert b"do not serve" not in body
    assert (
        api.client.get(
            f"/v1/jobs/{job_id}/checkpoints/9/download", headers=api.headers()
        ).status_code
        == 404
    )
    # The whole run folder a link elsewhere (another job's run): nothing is listed.
    other = str(api.submit()["id"])
    (api.settings.runs_root / other).symlink_to(api.settings.runs_root / job_id)
    got = api.client.get(f"/v1/jobs/{other}/checkpoints", headers=api.headers())
    assert got.status_code == 200 and got.json()["items"] == []


def test_a_failed_export_is_listed_failed_with_its_reason(
    api: Api, sim: Callable[..., WorkerSim], trained: Path, tmp_path: Path, capsys: Any
) -> None:
    """The trainer's export of step 2 fails for real (its dataset names a tokenizer that is
    gone): the listing says hf failed and why, a download of hf answers with that reason,
    and the native download does not carry the record."""
    from trainer.publish import publish

    job_id = _job_with_run(api, sim, trained)
    step2 = api.settings.runs_root / job_id / "checkpoints" / "step-2"
    dataset = tmp_path / "old-dataset"
    dataset.mkdir()
    gone = tmp_path / "moved" / "tokenizer.json"
    (dataset / "meta.json").write_text(json.dumps({"tokenizer": str(gone)}))
    assert publish(step2, dataset) is None
    assert "hf: could not write" in capsys.readouterr().err
    base = f"/v1/jobs/{job_id}/checkpoints"
    items = api.client.get(base, headers=api.headers()).json()["items"]
    failed = items[0]["exports"]["hf"]
    assert failed["status"] == "failed" and failed["size_bytes"] is None
    assert "prepare it again" in failed["reason"] and items[0]["formats"] == ["native"]
    ready = items[1]["exports"]["hf"]
    assert ready["status"] == "ready" and ready["size_bytes"] == items[1]["hf_size_bytes"] > 0
    assert "peft" not in items[1]["exports"]  # not a LoRA run: none asked for
    hf = api.client.get(f"{base}/2/download", params={"format": "hf"}, headers=api.headers())
    assert hf.status_code == 409
    assert (
        hf.json()["detail"]
        == f"the hf export of checkpoint step 2 of job {job_id} failed: " + failed["reason"]
    )
    peft = api.client.get(f"{base}/4/download", params={"format": "peft"}, headers=api.headers())
    assert peft.status_code == 409 and "no PEFT adapter" in peft.json()["detail"]
    native = api.client.get(f"{base}/2/download", headers=api.headers())
    assert native.status_code == 200 and "hf.failed.json" not in _members(native.content)
    # A record that is a link is not read (nor followed): the export is simply not there.
    (step2 / "hf.failed.json").unlink()
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"reason": "do not serve"}))
    (step2 / "hf.failed.json").symlink_to(secret)
    items = api.client.get(base, headers=api.headers()).json()["items"]
    assert "hf" not in items[0]["exports"]
    hf = api.client.get(f"{base}/2/download", params={"format": "hf"}, headers=api.headers())
    assert hf.status_code == 409 and "do not serve" not in hf.text


def test_a_checkpoint_pruned_mid_download_still_arrives_whole(
    api: Api, sim: Callable[..., WorkerSim], trained: Path
) -> None:
    """Retention deletes a checkpoint while it is being sent: the files were opened when
    the request was answered, so the archive still comes whole and matches a fresh one."""
    job_id = _job_with_run(api, sim, trained)
    expected = api.client.get(
        f"/v1/jobs/{job_id}/checkpoints/4/download", headers=api.headers()
    ).content
    ck_fd = checkpoints_dir(api.settings.runs_root, job_id)
    assert ck_fd is not None
    opened = open_format(ck_fd, 4, "native")
    os.close(ck_fd)
    assert opened is not None
    archive = Archive(*opened)
    archive.open_files()

    async def consume() -> bytes:
        chunks = archive.body()
        got = [await anext(chunks)]
        shutil.rmtree(api.settings.runs_root / job_id / "checkpoints" / "step-4")
        got += [chunk async for chunk in chunks]
        return b"".join(got)

    try:
        assert asyncio.run(consume()) == expected
    finally:
        archive.close()
    assert not (api.settings.runs_root / job_id / "checkpoints" / "step-4").exists()


def test_a_file_gone_before_its_turn_cuts_the_download_short(api: Api) -> None:
    """Past MAX_OPEN files (opened as their turn comes), a checkpoint deleted mid-download
    ends the stream early: the client gets fewer bytes than Content-Length (an error, never
    a shorter archive that looks whole), and the server goes on serving."""
    job_id = str(api.submit()["id"])
    step = api.settings.runs_root / job_id / "checkpoints" / "step-1"
    (step / "dcp").mkdir(parents=True)
    blob = os.urandom(64 * 1024)
    for i in range(MAX_OPEN + 20):  # ~18 MB: far more than the socket buffers hold
        (step / "dcp" / f"__{i}_0.distcp").write_bytes(blob)
    (step / "meta.json").write_text('{"step": 1}')
    (step / DONE).write_text("1\n")
    with Uvicorn(api.app) as server, httpx.Client(base_url=server.url) as client:
        url = f"/v1/jobs/{job_id}/checkpoints/latest/download"
        with client.stream("GET", url, headers=api.headers()) as resp:
            assert resp.status_code == 200
            total = int(resp.headers["content-length"])
            chunks = resp.iter_raw()
            got = len(next(chunks))
            shutil.rmtree(step)
            with pytest.raises(httpx.RemoteProtocolError):
                for chunk in chunks:
                    got += len(chunk)
        assert 0 < got < total
        listed = client.get(f"/v1/jobs/{job_id}/checkpoints", headers=api.headers())
        assert listed.status_code == 200 and listed.json()["items"] == []


def test_a_host_without_transformers_skips_the_hf_folder_in_one_line(
    trained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    from trainer.publish import HF_DIR, publish

    run = tmp_path / "run"
    shutil.copytree(trained, run)
    monkeypatch.setitem(sys.modules, "transformers", None)  # what find_spec sees: absent
    assert publish(run / "checkpoints" / "step-2") is None
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "transformers not installed" in out[0], out
    assert not (run / "checkpoints" / "step-2" / HF_DIR).exists()
    record = json.loads((run / "checkpoints" / "step-2" / "hf.failed.json").read_text())
    assert "transformers not installed on the worker" in record["reason"]
    # A folder already there is kept as it is, whatever the host has.
    assert publish(run / "checkpoints" / "step-4") == run / "checkpoints" / "step-4" / HF_DIR


def test_cli_lists_and_downloads_into_a_folder(
    api: Api, sim: Callable[..., WorkerSim], trained: Path, tmp_path: Path
) -> None:
    job_id = _job_with_run(api, sim, trained)
    step4 = api.settings.runs_root / job_id / "checkpoints" / "step-4"
    with Uvicorn(api.app) as server:
        env = {"TRAINQ_URL": server.url, "TRAINQ_TOKEN": api.token}

        def trainq(*args: str) -> Any:
            return CliRunner().invoke(cli.app, list(args), env=env, catch_exceptions=False)

        listed = trainq("checkpoints", job_id)
        assert listed.exit_code == 0, listed.stderr
        lines = listed.stdout.splitlines()
        assert lines[0].split()[:2] == ["STEP", "TIME"]
        assert lines[2].startswith("4 *") and "native,hf" in lines[2]
        assert "hf:failed" not in listed.stdout
        out = tmp_path / "model"
        got = trainq("download", job_id, "--format", "hf", "-o", str(out))
        assert got.exit_code == 0, got.stderr
        assert "downloaded step 4" in got.stdout
        assert _files(out) == _files(step4 / "hf")
        again = trainq("download", job_id, "--step", "2", "-o", str(out))
        assert again.exit_code == 2 and "not empty" in again.stderr
        forced = trainq("download", job_id, "--step", "2", "-o", str(out), "--force")
        assert forced.exit_code == 0, forced.stderr
        assert (out / "model.pt").is_file() and (out / "config.json").is_file()
        conflict = trainq(
            "download", job_id, "--step", "2", "--format", "hf", "-o", str(tmp_path / "x")
        )
        assert conflict.exit_code == 6 and conflict.stderr.count("\n") == 1
        assert "conflict (409)" in conflict.stderr and not (tmp_path / "x").exists()
        assert not [p for p in tmp_path.iterdir() if ".part-" in p.name]
        bad = trainq("download", job_id, "--step", "x", "-o", str(tmp_path / "y"))
        assert bad.exit_code == 2 and "--step" in bad.stderr


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_cli_downloads_a_lora_runs_peft_adapter_that_peft_loads(
    api: Api, sim: Callable[..., WorkerSim], lora_trained: Path, tmp_path: Path
) -> None:
    """`trainq download --format peft` of a LoRA run: PeftModel on the base (the run's base
    weights, `trainer.export --format hf --base` of the native download) computes what the
    hf download (merged) computes."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from trainer.export import main as export_main

    job_id = _job_with_run(api, sim, lora_trained)
    listed = api.client.get(f"/v1/jobs/{job_id}/checkpoints", headers=api.headers()).json()
    last = listed["items"][-1]
    assert last["formats"] == ["native", "hf", "peft"]
    assert last["exports"]["peft"]["status"] == "ready"
    native = {k for k in _files(lora_trained / "checkpoints" / "step-2") if "/" not in k}
    assert last["size_bytes"] == sum(
        (lora_trained / "checkpoints" / "step-2" / k).stat().st_size for k in native
    )
    with Uvicorn(api.app) as server:
        env = {"TRAINQ_URL": server.url, "TRAINQ_TOKEN": api.token}

        def trainq(*args: str) -> Any:
            return CliRunner().invoke(cli.app, list(args), env=env, catch_exceptions=False)

        for fmt in ("peft", "hf", "native"):
            got = trainq("download", job_id, "--format", fmt, "-o", str(tmp_path / fmt))
            assert got.exit_code == 0, got.stderr
    assert sorted(p.name for p in (tmp_path / "peft").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    argv = ["--checkpoint", str(tmp_path / "native"), "--format", "hf", "--base"]
    assert export_main([*argv, "--out", str(tmp_path / "base")]) == 0
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", local_files_only=True)
    adapted = PeftModel.from_pretrained(base, tmp_path / "peft").eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (adapted(input_ids=tokens).logits - merged(input_ids=tokens).logits).abs().max()
    assert diff.item() <= 1e-4
