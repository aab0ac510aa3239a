"""The client commands against a running system: exit codes, following, and one-line errors."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from service.cli.client import (
    EXIT_CANCELLED,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_REJECTED,
    EXIT_TIMEOUT,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
)
from tests.cli.conftest import CliSystem, Run, as_in_a_terminal, one_line, trainq_argv
from tests.e2e.system import create_token, free_port, wait_for

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def done_job(cli_system: CliSystem) -> dict[str, str]:
    """A job that ran to success, submitted with --follow (shared by the read-only tests)."""
    spec = cli_system.spec("cli-ok")
    proc = subprocess.run(
        [*trainq_argv(), "submit", str(spec), "--follow", "--set", "train.steps=6"],
        env={**cli_system.system.env, "TRAINQ_URL": cli_system.api.url},
        capture_output=True,
        text=True,
        timeout=180,
    )
    return {"code": str(proc.returncode), "out": proc.stdout, "err": proc.stderr}


def _job_id(out: str) -> str:
    first = out.splitlines()[0]
    assert first.startswith("job "), out
    return first.split()[1]


def test_submit_follow_succeeds_with_exit_0(
    done_job: dict[str, str], cli_system: CliSystem
) -> None:
    assert done_job["code"] == str(EXIT_OK), done_job
    out = done_job["out"]
    job_id = _job_id(out)
    assert f"{cli_system.api.url}/v1/jobs/{job_id}" in out.splitlines()[0]
    # Not a terminal: plain progress lines, the last step among them, then the outcome.
    assert "step 6/6" in out, out
    assert "\r" not in out and "\x1b" not in out
    assert out.rstrip().splitlines()[-1].startswith(f"job {job_id} succeeded"), out
    with cli_system.api.client() as http:
        assert http.get(f"/v1/jobs/{job_id}").json()["status"] == "succeeded"


def test_status_json_and_human(
    done_job: dict[str, str], cli_system: CliSystem, trainq: Run
) -> None:
    job_id = _job_id(done_job["out"])
    r = trainq("status", job_id, "--json", url=cli_system.api.url)
    assert r.code == 0, r
    job = json.loads(r.out)
    assert job["id"] == job_id and job["status"] == "succeeded"
    assert job["latest"]["step"] == 6 and job["train"]["steps"] == 6
    r = trainq("status", job_id, url=cli_system.api.url)
    assert r.code == 0 and "status:   succeeded" in r.out and "step 6/6" in r.out, r


def test_metrics_csv_has_a_row_per_step(
    done_job: dict[str, str], cli_system: CliSystem, trainq: Run
) -> None:
    job_id = _job_id(done_job["out"])
    r = trainq("metrics", job_id, "--csv", url=cli_system.api.url)
    assert r.code == 0, r
    rows = list(csv.DictReader(io.StringIO(r.out)))
    assert [int(row["step"]) for row in rows] == [1, 2, 3, 4, 5, 6]
    assert all(float(row["loss"]) > 0 for row in rows)
    table = trainq("metrics", job_id, url=cli_system.api.url)
    assert table.code == 0 and table.out.splitlines()[0].split()[:2] == ["STEP", "LOSS"]


def test_ls_filters_by_label_and_workers_and_queues_list_the_worker(
    done_job: dict[str, str], cli_system: CliSystem, trainq: Run
) -> None:
    job_id = _job_id(done_job["out"])
    r = trainq("ls", "--label", "purpose:cli-test", "--status", "succeeded", url=cli_system.api.url)
    assert r.code == 0 and job_id in r.out, r
    r = trainq("ls", "--label", "purpose:nothing-has-this", url=cli_system.api.url)
    assert r.code == 0 and job_id not in r.out and "no jobs" in r.out
    r = trainq("workers", url=cli_system.api.url)
    assert r.code == 0 and "cpu" in r.out and r.out.startswith("NAME"), r
    r = trainq("queues", url=cli_system.api.url)
    assert r.code == 0 and r.out.startswith("QUEUE"), r
    [cpu] = [line.split() for line in r.out.splitlines() if line.startswith("cpu ")]
    assert cpu[1:3] == ["1", "1/1"], r.out  # one worker, its one slot free now


def test_submit_wait_failure_exits_1_with_the_reason(cli_system: CliSystem, trainq: Run) -> None:
    # Decoupled weight decay at lr 10 multiplies the weights by -99 a step: the loss overflows.
    spec = cli_system.spec(
        "cli-nan",
        steps=50,
        optim={"lr": 10.0, "weight_decay": 10.0, "grad_clip": 0.0, "warmup_steps": 0},
    )
    r = trainq("submit", str(spec), "--wait", url=cli_system.api.url, timeout=180)
    assert r.code == EXIT_FAILED, r
    assert "failed (nan_loss)" in one_line(r.err), r


def test_submit_wait_cancel_exits_3(cli_system: CliSystem, trainq: Run) -> None:
    spec = cli_system.spec("cli-cancel", steps=100_000)
    env = {**cli_system.system.env, "TRAINQ_URL": cli_system.api.url}
    with subprocess.Popen(
        [*trainq_argv(), "submit", str(spec), "--wait"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as waiter:  # its pipes are closed however the test ends (-W error: no ResourceWarning)
        try:
            assert waiter.stdout is not None
            job_id = _job_id(waiter.stdout.readline())
            with cli_system.api.client() as http:
                wait_for(
                    lambda: http.get(f"/v1/jobs/{job_id}").json()["status"] == "running",
                    90,
                    "the job to run",
                    every=0.2,
                )
            r = trainq("cancel", job_id, url=cli_system.api.url)
            assert r.code == 0 and r.out.startswith(f"job {job_id} cancel"), r
            out, err = waiter.communicate(timeout=90)
        finally:
            if waiter.poll() is None:
                waiter.kill()
    assert waiter.returncode == EXIT_CANCELLED, (out, err)
    assert f"job {job_id} cancelled" in one_line(err)


def test_logs_follow_ends_when_the_job_ends(cli_system: CliSystem, trainq: Run) -> None:
    spec = cli_system.spec("cli-logs", steps=8)
    r = trainq("submit", str(spec), "-q", url=cli_system.api.url)
    assert r.code == 0, r
    job_id = r.out.strip()
    assert len(r.out.splitlines()) == 1  # -q: the id alone, for $(trainq submit -q ...)
    started = time.monotonic()
    logs = trainq("logs", job_id, "-f", url=cli_system.api.url, timeout=180)
    assert logs.code == 0, logs
    with cli_system.api.client() as http:
        # logs -f returned on its own, so the job must be over (not merely quiet).
        assert http.get(f"/v1/jobs/{job_id}").json()["status"] == "succeeded"
    assert "[a1 rank 0]" in logs.out and "step 8/8" in logs.out, logs.out[-2000:]
    assert time.monotonic() - started < 170
    tail = trainq("logs", job_id, "--tail", "2", url=cli_system.api.url)
    assert tail.code == 0 and len(tail.out.splitlines()) == 2, tail


# -- waiting on a job that waits: --timeout holds, and it says why it waits ---------------------

NO_WORKER = "nobody-serves-this"


@pytest.fixture()
def unserved(cli_system: CliSystem) -> Iterator[list[str]]:
    """Submit arguments for a job on a queue no worker serves; such jobs are cancelled after."""
    spec = cli_system.spec("cli-unserved")
    yield ["submit", str(spec), "--set", f"queue={NO_WORKER}"]
    with cli_system.api.client() as http:
        page = http.get("/v1/jobs", params={"status": "queued", "name": "cli-unserved"}).json()
        for job in page["items"]:
            http.post(f"/v1/jobs/{job['id']}/cancel")


def test_submit_wait_timeout_holds_while_the_job_is_queued(
    cli_system: CliSystem, trainq: Run, unserved: list[str]
) -> None:
    # A queued job's stream sends only keep-alive comments: the deadline must not wait for
    # an event. Not a timing assertion: without the fix this never returns (the 60 s fail it).
    r = trainq(*unserved, "--wait", "--timeout", "3", url=cli_system.api.url, timeout=60)
    assert r.code == EXIT_TIMEOUT, r
    job_id = _job_id(r.out)
    line = one_line(r.err)
    assert line.startswith("trainq: error: gave up waiting after 3s: "), line
    assert f"job {job_id} stays queued (no worker serves queue {NO_WORKER})" in line


def test_submit_wait_timeout_holds_while_keepalives_arrive(
    cli_system: CliSystem, trainq: Run, unserved: list[str]
) -> None:
    # An API that pings every 0.3 s: each keep-alive comment restarts the read timeout, so
    # a deadline looked at only between events (or left to the read timeout) never comes.
    system = cli_system.system
    system.env["TRAINQ_SSE_PING_S"] = "0.3"
    try:
        chatty = system.start_api(auth=False)
    finally:
        del system.env["TRAINQ_SSE_PING_S"]
    r = trainq(*unserved, "--wait", "--timeout", "3", url=chatty.url, timeout=60)
    assert r.code == EXIT_TIMEOUT, r
    job_id = _job_id(r.out)
    line = one_line(r.err)
    assert line.startswith("trainq: error: gave up waiting after 3s: "), line
    assert f"job {job_id} stays queued (no worker serves queue {NO_WORKER})" in line
    # The stream did send keep-alives while the job waited (so the test tests them).
    with (
        httpx.stream("GET", f"{chatty.url}/v1/jobs/{job_id}/events", timeout=5) as stream,
        contextlib.closing(stream.iter_lines()) as lines,
    ):
        assert any(line.startswith(":") for line, _ in zip(lines, range(20), strict=False))
    chatty.proc.stop()


def test_follow_says_why_it_waits_and_how_to_cancel_on_timeout(
    cli_system: CliSystem, trainq: Run, unserved: list[str]
) -> None:
    r = trainq(*unserved, "--follow", "--timeout", "4", url=cli_system.api.url, timeout=60)
    assert r.code == EXIT_TIMEOUT, r
    job_id = _job_id(r.out)
    # Said once when following starts, not again while it does not change.
    assert r.out.splitlines()[1:] == [f"waiting: no worker serves queue {NO_WORKER}"], r.out
    line = one_line(r.err)
    assert f"job {job_id} stays queued" in line, line
    # The cancel hint is a command that runs as printed (no bare `trainq` off PATH).
    hint = re.search(r"cancel it with `([^`]+)`", line)
    assert hint is not None, line
    env = {**cli_system.system.env, "TRAINQ_URL": cli_system.api.url, "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        shlex.split(hint.group(1)), env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout.startswith(f"job {job_id} cancel"), done


def test_ctrl_c_while_following_exits_130_and_says_the_job_stays(
    cli_system: CliSystem, unserved: list[str]
) -> None:
    env = {**cli_system.system.env, "TRAINQ_URL": cli_system.api.url}
    with subprocess.Popen(
        as_in_a_terminal([*trainq_argv(), *unserved, "--follow"]),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as waiter:
        try:
            assert waiter.stdout is not None
            job_id = _job_id(waiter.stdout.readline())
            assert waiter.stdout.readline().startswith("waiting: no worker serves queue")
            waiter.send_signal(signal.SIGINT)
            out, err = waiter.communicate(timeout=60)
        finally:
            if waiter.poll() is None:
                waiter.kill()
    assert waiter.returncode == 130, (out, err)
    line = one_line(err)
    assert line.startswith(f"trainq: stopped waiting (Ctrl-C): job {job_id} stays queued"), line
    assert f"cancel {job_id}`" in line


# -- one clear line for every error, never a traceback ------------------------------------------


def test_unreachable_service(trainq: Run) -> None:
    r = trainq("status", "abc123", url=f"http://127.0.0.1:{free_port()}")
    assert r.code == EXIT_UNREACHABLE
    assert "cannot reach the trainq service" in one_line(r.err)


def test_unauthorized(cli_system: CliSystem, trainq: Run) -> None:
    r = trainq("ls", url=cli_system.secure.url)
    assert r.code == EXIT_REJECTED
    line = one_line(r.err)
    assert "unauthorized (401)" in line and "TRAINQ_TOKEN" in line
    r = trainq("ls", url=cli_system.secure.url, token="tq_not-a-real-token")
    assert r.code == EXIT_REJECTED and "401" in one_line(r.err)
    token = create_token(cli_system.system.env["TRAINQ_DATABASE_URL"], "cli-user")
    r = trainq("ls", url=cli_system.secure.url, token=token)
    assert r.code == 0 and r.err == "", r  # TRAINQ_TOKEN is sent as the bearer token


def test_not_found(cli_system: CliSystem, trainq: Run) -> None:
    r = trainq("status", "deadbeef", url=cli_system.api.url)
    assert r.code == EXIT_REJECTED
    assert "not found (404)" in one_line(r.err)


@pytest.mark.parametrize(
    "override, field",
    [
        ("train.steps=0", "train.steps"),
        ("train.optim.lrr=0.1", "train.optim.lrr"),
        ("train.model.n_head=3", "train.model"),
        ("procs_per_node=1000", "procs_per_node"),
        ("train.data.path=../../etc", "train.data.path"),
    ],
)
def test_invalid_spec_names_the_field(
    cli_system: CliSystem, trainq: Run, override: str, field: str
) -> None:
    spec = cli_system.spec("cli-bad")
    r = trainq("submit", str(spec), "--wait", "--set", override, url=cli_system.api.url)
    assert r.code == EXIT_REJECTED
    line = one_line(r.err)
    assert line.startswith("trainq: error: invalid job spec: ") and f"{field}" in line, line
    assert "body." not in line  # the path is the spec's own, not the request's


def test_too_large(cli_system: CliSystem, trainq: Run) -> None:
    # The spec is parsed here and sent as JSON: a value over the 1 MiB body limit.
    spec = cli_system.spec("cli-huge")
    spec.write_text(spec.read_text().replace("name: cli-huge", "name: " + "x" * 1_100_000))
    r = trainq("submit", str(spec), url=cli_system.api.url)
    assert r.code == EXIT_REJECTED and "too large (413)" in one_line(r.err), r


@pytest.mark.parametrize(
    "content, args, needle",
    [
        (None, [], "cannot read"),
        ("name: [unclosed", [], "is not a valid YAML spec"),
        ("name: a\nname: b", [], "line 2: key 'name' is given twice"),
        ("a: &x [1]\nb: *x", [], "aliases"),
        ("- a list", [], "must hold a mapping"),
        ("name: x", ["--set", "oops"], "is not KEY.PATH=VALUE"),
        ("name: x", ["--set", "name.first=1"], "name is not a mapping"),
    ],
)
def test_bad_spec_file_is_a_usage_error(
    tmp_path: object, trainq: Run, content: str | None, args: list[str], needle: str
) -> None:
    from pathlib import Path

    spec = Path(str(tmp_path)) / "spec.yaml"
    if content is not None:
        spec.write_text(content)
    # No service is needed: the file is refused before anything is sent.
    r = trainq("submit", str(spec), *args, url=f"http://127.0.0.1:{free_port()}")
    assert r.code == EXIT_USAGE
    assert needle in one_line(r.err)


def test_data_prepare(tmp_path: object, trainq: Run) -> None:
    from pathlib import Path

    tmp = Path(str(tmp_path))
    text = tmp / "corpus.txt"
    text.write_text("hello trainq\n" * 500)
    r = trainq("data", "prepare", str(text), "--out", str(tmp / "shards"), url="http://x")
    assert r.code == 0 and r.out.startswith(f"prepared {tmp / 'shards'}"), r
    assert sorted(p.name for p in (tmp / "shards").glob("*.bin")) == [
        "train_000000.bin",
        "val_000000.bin",
    ]
    again = trainq("data", "prepare", str(text), "--out", str(tmp / "shards"), url="http://x")
    assert again.code == 1 and "already holds shards" in one_line(again.err)


def test_client_sees_the_submitted_spec_as_sent(cli_system: CliSystem) -> None:
    # The --set value is parsed as YAML; 3e-4 (no dot) would be a string in YAML 1.1.
    from service.cli.specfile import load_spec

    spec = load_spec(cli_system.spec("cli-set"), ["train.optim.lr=3e-4", "labels.x=y"])
    assert spec["train"]["optim"]["lr"] == pytest.approx(3e-4)
    assert spec["labels"] == {"purpose": "cli-test", "x": "y"}
    with httpx.Client(base_url=cli_system.api.url) as http:
        assert (
            http.post("/v1/jobs", json={**spec, "train": {**spec["train"], "steps": 0}}).status_code
            == 422
        )


def test_ci_pipeline_example_gates_on_the_outcome(cli_system: CliSystem, repo_root: Path) -> None:
    script = repo_root / "examples/ci-pipeline.sh"
    env = {**cli_system.system.env, "TRAINQ_URL": cli_system.api.url, "CI_RUN_ID": "t1"}
    # `trainq` on PATH, as a CI image with trainq installed has it.
    bin_dir = cli_system.spec_dir / "bin"
    bin_dir.mkdir(exist_ok=True)
    shim = bin_dir / "trainq"
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} -m service.cli "$@"\n')
    shim.chmod(0o755)
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    ok = subprocess.run(
        [str(script), str(cli_system.spec("ci-ok", steps=3))],
        env=env, capture_output=True, text=True, timeout=200, cwd=repo_root,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.count("succeeded") >= 2 and "gate passed" in ok.stdout
    bad = cli_system.spec("ci-bad", steps=3)
    bad.write_text(bad.read_text().replace("steps: 3", "steps: 0"))
    refused = subprocess.run(
        [str(script), str(bad)], env=env, capture_output=True, text=True, timeout=60, cwd=repo_root
    )
    assert refused.returncode != 0  # curl -f fails on the 422 before anything waits


# -- --set on a spec file: one alternative replaces the other (tests/cli/test_spec_overrides.py)

CORPUS = "A newcomer trains on what was uploaded, not on the demo folder.\n" * 200


def test_set_dataset_on_a_spec_with_a_path_trains_on_the_dataset(
    cli_system: CliSystem, trainq: Run, tmp_path: Path
) -> None:
    url = cli_system.api.url
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(CORPUS, encoding="utf-8")
    up = trainq("data", "upload", str(corpus), "--name", "newcomer", "--wait", url=url)
    assert up.code == 0, up.err
    hint = next(w for w in up.out.split() if w.startswith("train.data.dataset="))

    spec = cli_system.spec("on-upload")  # data: {path: demo}, as the examples have
    assert "path: demo" in spec.read_text()
    done = trainq("submit", str(spec), "--wait", "--set", hint, url=url, timeout=240)
    assert done.code == 0, (done.out, done.err)
    job_id = done.out.split()[1]
    shown = trainq("status", job_id, "--json", url=url)
    job = json.loads(shown.out)
    folder = json.loads(trainq("data", "show", "newcomer", "--json", url=url).out)["path"]
    # Stored: the dataset, its folder frozen as the path; never the spec file's "demo".
    data = job["train"]["data"]
    assert data["dataset"] == "newcomer" and data["path"] == folder != "demo", data

    # The other way: a path over a spec that names a dataset.
    back = trainq("plan", str(spec), "--set", hint, "--set", "train.data.path=demo", url=url)
    assert back.code == 0, back.err
    # Both in the file (the user wrote both): the API still refuses, naming the field.
    both = tmp_path / "both.yaml"
    both.write_text(spec.read_text().replace("path: demo", "path: demo\n    dataset: newcomer"))
    refused = trainq("submit", str(both), url=url)
    assert refused.code == 6 and "not both" in one_line(refused.err), refused
    assert trainq("data", "rm", "newcomer", url=url).code == 0
