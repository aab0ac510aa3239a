"""lm-evaluation-harness against trainq, offline, as an evaluation user runs it.

A tiny job is trained by a real worker; lm-eval's ``local-completions`` backend then scores
the shipped multiple-choice task (``examples/lmeval``) through trainq's OpenAI surface:
loglikelihoods from ``echo`` + ``logprobs`` on ``/v1/completions``, the tokenizer remote
through ``/tokenize`` and ``/tokenizer_info`` (so no local tokenizer), prompts batched into
lists and sent concurrently. lm-eval's own ``hf`` backend scores the same task on the job's
downloaded Hugging Face export in this process. Both must give the same accuracy and the
same per-choice loglikelihoods within 1e-3.

One system for the module (``fast_system``); lm-eval itself is the outside client, unmodified.
"""

from __future__ import annotations

import io
import shutil
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.system import Api, System, create_token, wait_for

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]
TASK = "trainq_mc"
QUEUE = "lmeval"
SEQ_LEN = 64
TRAIN: dict[str, Any] = {
    "steps": 20,
    "seed": 5,
    "model": {"n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": SEQ_LEN, "vocab_size": 256},
    "data": {"path": "demo"},
    "batch": {"micro_batch_size": 4},
    "optim": {"lr": 1e-2, "warmup_steps": 2},
    "eval": {"every": 0},
    "checkpoint": {"every": 20, "keep": 1, "hf": "final"},
    "log_every": 5,
}


def task_dir(tmp: Path) -> Path:
    """The shipped task, its data path made absolute (the YAML's is relative to the repo)."""
    src = REPO / "examples" / "lmeval"
    out = tmp / "tasks"
    out.mkdir()
    shutil.copy(src / f"{TASK}.jsonl", out)
    text = (src / f"{TASK}.yaml").read_text()
    rel = f"examples/lmeval/{TASK}.jsonl"
    assert rel in text
    (out / f"{TASK}.yaml").write_text(text.replace(rel, str(out / f"{TASK}.jsonl")))
    return out


class Eval:
    def __init__(self, api: Api, job_id: str, export: Path, tasks: Path) -> None:
        self.api, self.job_id, self.export, self.tasks = api, job_id, export, tasks

    def run(self, model: str, model_args: str, batch_size: int) -> dict[str, Any]:
        from lm_eval import simple_evaluate
        from lm_eval.tasks import TaskManager

        return simple_evaluate(
            model=model,
            model_args=model_args,
            tasks=[TASK],
            task_manager=TaskManager(include_path=str(self.tasks)),
            batch_size=batch_size,
            device="cpu",
            log_samples=True,
        )


@pytest.fixture(scope="module")
def lmeval(fast_system: System, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Eval]:
    tmp = tmp_path_factory.mktemp("lmeval")
    api = fast_system.start_api(auth=True)
    api.token = create_token(fast_system.env["TRAINQ_DATABASE_URL"], "lmeval-user")
    fast_system.start_worker(QUEUE, name="lmeval-worker")
    with api.client() as c:
        r = c.post("/v1/jobs", json={"name": "lm", "queue": QUEUE, "train": TRAIN})
        assert r.status_code == 201, r.text
        job_id = str(r.json()["id"])

    def done() -> bool:
        with api.client() as c:
            status = c.get(f"/v1/jobs/{job_id}").json()["status"]
        assert status in ("queued", "running", "succeeded"), status
        return status == "succeeded"

    wait_for(done, 180, f"the tiny training run {job_id}", every=0.3)
    export = tmp / "export"
    with api.client() as c:
        r = c.get(f"/v1/jobs/{job_id}/checkpoints/latest/download", params={"format": "hf"})
    assert r.status_code == 200, r.text
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
        tar.extractall(export, filter="data")
    yield Eval(api, job_id, export, task_dir(tmp))


def per_choice(out: dict[str, Any]) -> dict[int, list[float]]:
    """doc id -> each choice's loglikelihood, from lm-eval's logged samples."""
    return {s["doc_id"]: [float(r[0]) for r in s["filtered_resps"]] for s in out["samples"][TASK]}


def test_local_completions_equals_the_hf_backend_on_the_export(
    lmeval: Eval, monkeypatch: pytest.MonkeyPatch
) -> None:
    # local-completions sends OPENAI_API_KEY as its bearer token; the remote tokenizer takes
    # auth_token. The base URL scopes one model, so /tokenize needs no model field.
    monkeypatch.setenv("OPENAI_API_KEY", str(lmeval.api.token))
    base = f"{lmeval.api.url}/models/{lmeval.job_id}/v1/completions"
    ours = lmeval.run(
        "local-completions",
        f"model={lmeval.job_id},base_url={base},tokenizer_backend=remote,"
        f"auth_token={lmeval.api.token},num_concurrent=2,max_retries=1,"
        f"max_length={SEQ_LEN},tokenized_requests=True",
        batch_size=8,
    )
    theirs = lmeval.run("hf", f"pretrained={lmeval.export},dtype=float32", batch_size=8)

    acc = ours["results"][TASK]["acc,none"]
    assert acc == theirs["results"][TASK]["acc,none"]
    a, b = per_choice(ours), per_choice(theirs)
    assert sorted(a) == sorted(b) and len(a) == 24
    worst = max(abs(x - y) for d in a for x, y in zip(a[d], b[d], strict=True))
    assert worst < 1e-3, worst
    # The loglikelihoods discriminate: not every choice of a question scores the same.
    assert any(len({round(x, 3) for x in a[d]}) > 1 for d in a)
