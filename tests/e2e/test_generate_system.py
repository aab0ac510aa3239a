"""Generation end to end: a tiny job trained by a real worker, then completions from its
checkpoint through the API (OpenAI's shape), generated on that worker and relayed over Redis.

One system for the module (``fast_system``: the API with auth on, PostgreSQL, Redis, one
Celery worker) and one tiny training run shared by every test. The reference tokens come
from the same checkpoint loaded here (``trainer.export.load_model``) and decoded greedily by
``trainer.generate``, and from ``transformers``' ``generate`` on its Hugging Face export.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.system import Api, Proc, System, create_token, wait_for

pytestmark = pytest.mark.timeout(180)

QUEUE = "gen"
IDLE_QUEUE = "gen-idle"  # no worker serves it
SEQ_LEN = 48
TRAIN: dict[str, Any] = {
    "steps": 20,
    "seed": 3,
    "model": {"n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": SEQ_LEN, "vocab_size": 256},
    "data": {"path": "demo"},
    "batch": {"micro_batch_size": 4},
    "optim": {"lr": 1e-2, "warmup_steps": 2},
    "eval": {"every": 0},
    "checkpoint": {"every": 10, "keep": 2},
    "log_every": 5,
}
PROMPT = "A cold wind came from the "


class Gen:
    def __init__(self, system: System, api: Api, other: Api, worker: Proc) -> None:
        self.system, self.api, self.other, self.worker = system, api, other, worker
        self.runs_root = Path(system.env["TRAINQ_RUNS_ROOT"])

    def submit(self, name: str, queue: str = QUEUE, api: Api | None = None) -> str:
        body = {"name": name, "queue": queue, "procs_per_node": 1, "train": TRAIN}
        with (api or self.api).client() as c:
            r = c.post("/v1/jobs", json=body)
        assert r.status_code == 201, r.text
        return str(r.json()["id"])

    def wait_succeeded(self, job_id: str, api: Api | None = None) -> None:
        def done() -> bool:
            with (api or self.api).client() as c:
                status = c.get(f"/v1/jobs/{job_id}").json()["status"]
            assert status in ("queued", "running", "succeeded"), status
            return status == "succeeded"

        wait_for(done, 120, f"the tiny training run {job_id}", every=0.3)

    def post(self, body: dict[str, Any], api: Api | None = None) -> httpx.Response:
        with (api or self.api).client() as c:
            return c.post("/v1/completions", json=body, timeout=60)


@pytest.fixture(scope="module")
def gen(fast_system: System) -> Iterator[tuple[Gen, str]]:
    api = fast_system.start_api(auth=True)
    db = fast_system.env["TRAINQ_DATABASE_URL"]
    api.token = create_token(db, "gen-user")
    other = Api(api.url, api.proc, create_token(db, "gen-other"))
    worker = fast_system.start_worker(QUEUE, name="gen-worker")
    g = Gen(fast_system, api, other, worker)
    job_id = g.submit("gen-tiny")
    g.wait_succeeded(job_id)
    yield g, job_id


def reference(g: Gen, job_id: str, prompt: list[int], max_tokens: int) -> list[int]:
    from trainer.export import load_model
    from trainer.generate import Sampling, generate_ids

    model, _ = load_model(g.runs_root / job_id)
    params = Sampling(max_tokens=max_tokens, temperature=0)
    return [int(t[0]) for t in generate_ids(model, prompt, params)]


def test_greedy_completion_is_the_trainers_and_has_openais_shape(gen: tuple[Gen, str]) -> None:
    g, job_id = gen
    prompt = list(PROMPT.encode())
    r = g.post({"model": job_id, "prompt": PROMPT, "max_tokens": 16, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["model"] == job_id and isinstance(body["created"], int)
    [choice] = body["choices"]
    assert set(choice) >= {"text", "index", "logprobs", "finish_reason"}
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    expected = reference(g, job_id, prompt, 16)
    assert choice["token_ids"] == expected
    assert choice["text"] == bytes(expected).decode("utf-8", errors="replace")
    usage = body["usage"]
    assert usage == {
        "prompt_tokens": len(prompt),
        "completion_tokens": 16,
        "total_tokens": 16 + len(prompt),
    }
    assert body["trainq"]["step"] == 20 and body["trainq"]["load_s"] >= 0
    # The second request finds the model loaded; token ids as the prompt give the same.
    again = g.post({"model": f"{job_id}:20", "prompt": prompt, "max_tokens": 16, "temperature": 0})
    assert again.status_code == 200, again.text
    assert again.json()["trainq"]["cached"] is True
    assert again.json()["choices"][0]["token_ids"] == expected
    # The alias in the job's path answers the same.
    with g.api.client() as c:
        alias = c.post(f"/v1/jobs/{job_id}/generate", json={"prompt": PROMPT, "max_tokens": 16,
                                                              "temperature": 0})  # fmt: skip
    assert alias.status_code == 200 and alias.json()["choices"][0]["token_ids"] == expected


def test_greedy_equals_transformers_generate_on_the_hf_export(
    gen: tuple[Gen, str], tmp_path: Path
) -> None:
    import torch
    import transformers

    from trainer.export import export, load_model

    g, job_id = gen
    model, _ = load_model(g.runs_root / job_id)
    export(model, tmp_path / "hf", "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    prompt = list(PROMPT.encode())
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, pad_token_id=0)
    r = g.post({"model": job_id, "prompt": prompt, "max_tokens": 20, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == out[0, len(prompt) :].tolist()


def read_sse(response: httpx.Response) -> list[Any]:
    out: list[Any] = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_streamed_chunks_concatenate_to_the_answer_and_seeds_repeat(gen: tuple[Gen, str]) -> None:
    g, job_id = gen
    body = {"model": job_id, "prompt": PROMPT, "max_tokens": 20, "temperature": 0.9,
            "top_k": 40, "top_p": 0.95, "seed": 11, "n": 2}  # fmt: skip
    plain = g.post(body)
    assert plain.status_code == 200, plain.text
    texts = {c["index"]: c["text"] for c in plain.json()["choices"]}
    assert g.post(body).json()["choices"] == plain.json()["choices"], "a seed repeats exactly"
    with (
        g.api.client() as c,
        c.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                  "stream_options": {"include_usage": True}},
                 timeout=60) as r,
    ):  # fmt: skip
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        chunks = read_sse(r)
    assert chunks[-1] == "[DONE]"
    usage = chunks[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 40
    streamed = {0: "", 1: ""}
    finish = {}
    for chunk in chunks[:-2]:
        assert chunk["object"] == "text_completion" and chunk["model"] == job_id
        for ch in chunk["choices"]:
            streamed[ch["index"]] += ch["text"]
            if ch["finish_reason"]:
                finish[ch["index"]] = ch["finish_reason"]
    assert streamed == texts
    assert finish == {0: "length", 1: "length"}
    # A stop string ends a sequence before it (and the stream says so).
    stop = texts[0][5:7] if len(texts[0]) > 7 else None
    if stop and stop.strip():
        r = g.post({**body, "stop": [stop]})  # the same draws: the same text up to the stop
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop" and stop not in choice["text"]
        assert texts[0].startswith(choice["text"])


def test_bad_input_is_a_clear_4xx(gen: tuple[Gen, str]) -> None:
    """OpenAI's shape and statuses on /v1/completions: 400 with the field as ``param``."""
    g, job_id = gen

    def answer(body: dict[str, Any], api: Api | None = None) -> tuple[int, Any]:
        r = g.post({"model": job_id, "prompt": PROMPT, **body}, api)
        return r.status_code, r.json()["error"]

    status, error = answer({"max_tokens": 4097})
    assert status == 400 and error["param"] == "max_tokens"
    assert error["type"] == "invalid_request_error"
    status, error = answer({"prompt": "x" * (SEQ_LEN + 1)})
    assert status == 400 and error["param"] == "prompt" and "context" in error["message"]
    status, error = answer({"prompt": list(range(SEQ_LEN + 1))})
    assert status == 400 and error["param"] == "prompt"
    status, error = answer({"temperature": 2.5})
    assert status == 400 and error["param"] == "temperature"
    status, error = answer({"model": "../etc"})
    assert status == 400 and error["param"] == "model"
    status, error = answer({"max_tokens": 0})
    assert status == 400 and error["param"] == "max_tokens" and "echo" in error["message"]
    with g.api.client() as c:
        r = c.post(
            "/v1/completions", content=b"\xff{", headers={"Content-Type": "application/json"}
        )
    assert r.status_code == 400 and r.json()["error"]["param"] is None
    status, error = answer({"model": f"{job_id}:7"})
    assert status == 404 and "step 7" in error["message"] and error["code"] == "model_not_found"
    status, error = answer({}, g.other)
    assert status == 404 and job_id in error["message"], "another token's job does not exist"
    # A queued job (no worker serves its queue): no checkpoint yet, 409 naming why.
    idle = g.submit("gen-idle", IDLE_QUEUE)
    status, error = answer({"model": idle})
    assert status == 409 and "no complete checkpoint" in error["message"]
    # Given a checkpoint, the same job is a 503: no live worker serves its queue.
    shutil.copytree(g.runs_root / job_id, g.runs_root / idle)
    status, error = answer({"model": idle})
    assert status == 503 and IDLE_QUEUE in error["message"]
    # The job's own route keeps trainq's shape.
    with g.api.client() as c:
        r = c.post(f"/v1/jobs/{job_id}/generate", json={"prompt": PROMPT, "temperature": 2.5})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "temperature"]


def test_the_cli_streams_what_the_api_answers(gen: tuple[Gen, str]) -> None:
    import subprocess
    import sys

    g, job_id = gen
    r = g.post({"model": job_id, "prompt": PROMPT, "max_tokens": 12, "temperature": 0})
    env = {**g.system.env, "TRAINQ_URL": g.api.url, "TRAINQ_TOKEN": str(g.api.token)}
    argv = [sys.executable, "-m", "service.cli", "generate", job_id, PROMPT]
    argv += ["--max-tokens", "12", "--temperature", "0", "--stream"]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout == r.json()["choices"][0]["text"] + "\n"
    bad = subprocess.run([*argv[:4], "ffff", PROMPT], env=env, capture_output=True, text=True,
                         timeout=60, check=False)  # fmt: skip
    assert bad.returncode == 6 and bad.stderr.startswith("trainq: error:") and "ffff" in bad.stderr


def test_a_passed_deadline_is_a_504_not_a_hang(gen: tuple[Gen, str]) -> None:
    g, job_id = gen
    # A second API on the same system whose requests are due at once.
    g.system.env["TRAINQ_GENERATE_TIMEOUT_S"] = "0.001"
    try:
        hasty = g.system.start_api(auth=True)
    finally:
        del g.system.env["TRAINQ_GENERATE_TIMEOUT_S"]
    hasty.token = g.api.token
    r = g.post({"model": job_id, "prompt": PROMPT, "max_tokens": 30}, hasty)
    assert r.status_code == 504 and "deadline" in r.json()["error"]["message"], r.text
    # The worker goes on serving the others.
    ok = g.post({"model": job_id, "prompt": PROMPT, "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_a_busy_training_slot_does_not_block_generation(gen: tuple[Gen, str]) -> None:
    g, job_id = gen
    body = {"name": "gen-endless", "queue": QUEUE, "procs_per_node": 1,
            "train": {**TRAIN, "steps": 100_000, "checkpoint": {"every": 0}}}  # fmt: skip
    with g.api.client() as c:
        busy = c.post("/v1/jobs", json=body).json()["id"]

        def running() -> bool:  # the worker's one Celery slot holds the attempt
            return bool(c.get(f"/v1/jobs/{busy}").json()["status"] == "running")

        wait_for(running, 60, "the worker's only slot to be training", every=0.2)
        r = g.post({"model": job_id, "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        assert c.get(f"/v1/jobs/{busy}").json()["status"] == "running", "still training"
        c.post(f"/v1/jobs/{busy}/cancel")


def test_owners_take_turns_on_a_worker(gen: tuple[Gen, str]) -> None:
    """Owner A's burst of long requests, then owner B's one short request: B's is served
    next, not after all of A's (the worker used to serve in arrival order)."""
    import os
    import signal
    import threading

    import redis

    from worker.genmessage import request_stream

    g, job_a = gen
    job_b = g.submit("gen-tiny-b", api=g.other)
    g.wait_succeeded(job_b, g.other)
    long = {"model": job_a, "prompt": PROMPT, "max_tokens": 40, "n": 16, "temperature": 1.0}
    short = {"model": job_b, "prompt": PROMPT, "max_tokens": 5, "temperature": 0}
    for body, api in ((long, g.api), (short, g.other)):  # both models loaded: no load time
        assert g.post(body, api).status_code == 200
    client = redis.Redis.from_url(g.system.redis_url)
    stream = request_stream(QUEUE, g.system.prefix)
    order: list[str] = []
    codes: list[int] = []
    lock = threading.Lock()

    def ask(who: str, body: dict[str, Any], api: Api) -> None:
        r = g.post(body, api)
        with lock:
            order.append(who)
            codes.append(r.status_code)

    threads: list[threading.Thread] = []
    os.kill(g.worker.popen.pid, signal.SIGSTOP)  # every request waits in the stream first
    try:
        for i in range(6):
            threads.append(threading.Thread(target=ask, args=("A", {**long, "seed": i}, g.api)))
            threads[-1].start()
        wait_for(lambda: client.xlen(stream) == 6, 30, "A's six requests in the stream")
        threads.append(threading.Thread(target=ask, args=("B", short, g.other)))
        threads[-1].start()
        wait_for(lambda: client.xlen(stream) == 7, 30, "B's request behind them")
    finally:
        os.kill(g.worker.popen.pid, signal.SIGCONT)
        client.close()
    for t in threads:
        t.join(60)
    assert codes == [200] * 7, codes
    # At most A's first (taken before B's was read) and one more by the relay's timing
    # come before B; in arrival order B would be last.
    assert order.index("B") <= 2, order
    assert order[-3:] == ["A", "A", "A"], order
