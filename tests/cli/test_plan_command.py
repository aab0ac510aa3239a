"""``trainq plan SPEC``: the dry run through the real API (uvicorn, PostgreSQL, Redis), as a
user runs it; the same exit codes as the other client commands."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from service.cli.client import EXIT_OK, EXIT_REJECTED, EXIT_UNREACHABLE, EXIT_USAGE
from tests.cli.conftest import TINY, Run, one_line
from tests.e2e.system import Api, build_system, free_port

TERMS = ["weights", "gathered", "gradients", "optimizer", "activations", "optimizer_step", "total"]


@pytest.fixture(scope="module")
def plan_api(
    pg_url: str,
    redis_dbs: Any,
    subprocess_env: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Api]:
    """The API alone (auth off): a dry run needs no worker."""
    system = build_system(tmp_path_factory.mktemp("plan"), pg_url, redis_dbs, subprocess_env, {})
    try:
        yield system.start_api(auth=False)
    finally:
        system.stop()


def _spec(tmp_path: Path, **train: Any) -> Path:
    body = {**TINY, "train": {**TINY["train"], **train}}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def test_plan_prints_the_table(plan_api: Api, trainq: Run, tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    r = trainq("plan", str(spec), "--set", "train.activation_checkpointing=full", url=plan_api.url)
    assert r.code == EXIT_OK, r
    lines = r.out.splitlines()
    # TINY: 1 block of d=32 (12d^2 + 13d), token and position embeddings, ln_f.
    total = 12 * 32 * 32 + 13 * 32 + 256 * 32 + 32 * 32 + 2 * 32
    assert lines[0] == f"model:     gpt, {total:,} parameters ({total:,} trainable)"
    assert lines[1] == f"per step:  {4 * 32 * 2:,} tokens on 2 rank(s)"
    terms = [line.split()[0] for line in lines[3:11]]
    assert terms == ["MEMORY", *TERMS]
    assert all(line.split()[-1] in ("B", "KiB", "MiB") for line in lines[4:11])
    assert lines[-1] == "fits:      unknown: no worker serves queue cpu"
    assert "Traceback" not in r.err

    as_json = trainq("plan", str(spec), "--json", url=plan_api.url)
    assert as_json.code == EXIT_OK, as_json
    out = json.loads(as_json.out)
    assert out["parameters"]["total"] == total and out["fits"] is None
    assert out["memory"]["device"]["activations"] > 0


def test_plan_shows_offloaded_host_memory(plan_api: Api, trainq: Run, tmp_path: Path) -> None:
    spec = _spec(tmp_path, strategy="fsdp", fsdp={"cpu_offload": True})
    r = trainq("plan", str(spec), url=plan_api.url)
    assert r.code == EXIT_OK, r
    assert "HOST (OFFLOADED)" in r.out and "per node" in r.out


@pytest.mark.parametrize(
    "override, field",
    [("train.model.n_head=3", "train.model"), ("train.data.path=../../etc", "train.data.path")],
)
def test_a_bad_spec_is_refused_like_submit(
    plan_api: Api, trainq: Run, tmp_path: Path, override: str, field: str
) -> None:
    spec = _spec(tmp_path)
    r = trainq("plan", str(spec), "--set", override, url=plan_api.url)
    assert r.code == EXIT_REJECTED
    line = one_line(r.err)
    assert line.startswith("trainq: error: invalid job spec: ") and field in line, line
    assert r.out == ""


def test_an_unreadable_spec_is_a_usage_error(trainq: Run, tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text("name: [unclosed")
    # No service needed: the file is refused before anything is sent.
    r = trainq("plan", str(spec), url=f"http://127.0.0.1:{free_port()}")
    assert r.code == EXIT_USAGE and "is not a valid YAML spec" in one_line(r.err)
    r = trainq("plan", str(_spec(tmp_path)), url=f"http://127.0.0.1:{free_port()}")
    assert r.code == EXIT_UNREACHABLE and "cannot reach" in one_line(r.err)
