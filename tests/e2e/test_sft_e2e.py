"""Conversations in over HTTP, a model fine-tuned on their answers, served and downloaded.

Against the real system (uvicorn API with auth, PostgreSQL, Redis, one Celery worker for the
module, torchrun on CPU): ``trainq data upload --format chat --wait`` prints the dataset's
report; a bad line is refused by number before a byte is sent. Then the whole loop: a tiny
Qwen2-shaped Hugging Face folder and a byte-level BPE tokenizer trained here, with a chat
template that marks the answers with ``{% generation %}``; conversations uploaded with that
tokenizer, fine-tuned with LoRA (packed) by the worker, the export downloaded;
``/v1/chat/completions`` (the openai SDK) renders the template and answers greedily, and
transformers' ``apply_chat_template`` + ``generate`` on the download gives the same text."""

from __future__ import annotations

import io
import json
import os
import tarfile
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.system import Api, System, create_token, wait_for
from tests.e2e.test_datasets_e2e import trainq
from tests.tiny_hf import qwen2_model, qwen2_tokenizer

pytestmark = pytest.mark.timeout(240)

# The template's own format ("bot", not ChatML's "assistant"), answers marked for training.
TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'assistant' %}<|im_start|>bot {% generation %}"
    "{{ m.content }}<|im_end|>{% endgeneration %}{% else %}<|im_start|>{{ m.role }} "
    "{{ m.content }}<|im_end|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>bot {% endif %}"
)
WORDS = [
    "red",
    "green",
    "blue",
    "one",
    "two",
    "three",
    "four",
    "five",
    "cat",
    "dog",
    "sun",
    "moon",
    "what",
    "colour",
    "is",
    "number",
]


@dataclass
class Sft:
    system: System
    api: Api
    queue: str
    env: dict[str, str]
    data_root: Path
    worker: Future[Any]

    def run_job(self, body: dict[str, Any], timeout: float = 150) -> dict[str, Any]:
        self.worker.result(timeout=90)
        with self.api.client() as client:
            resp = client.post("/v1/jobs", json={"queue": self.queue, **body})
            assert resp.status_code == 201, resp.text
            job_id = resp.json()["id"]

            def ended() -> dict[str, Any] | None:
                found: dict[str, Any] = client.get(f"/v1/jobs/{job_id}").json()
                return found if found["status"] in ("succeeded", "failed", "cancelled") else None

            done: dict[str, Any] = wait_for(ended, timeout, f"job {job_id} to end", every=0.5)
        assert done["status"] == "succeeded", done
        return done


@pytest.fixture(scope="module")
def sft(fast_system: System) -> Iterator[Sft]:
    api = fast_system.start_api(auth=True)
    owner = f"sft-{uuid.uuid4().hex[:6]}"
    api.token = create_token(fast_system.env["TRAINQ_DATABASE_URL"], owner)
    queue = f"sft-{uuid.uuid4().hex[:6]}"
    with ThreadPoolExecutor(1) as pool:  # the worker starts while the first test uploads
        worker = pool.submit(fast_system.start_worker, queue, name=f"sft-{os.getpid()}")
        env = {**fast_system.env, "TRAINQ_URL": api.url, "TRAINQ_TOKEN": api.token}
        yield Sft(fast_system, api, queue, env, Path(fast_system.env["TRAINQ_DATA_ROOT"]), worker)


def _chat(user: str, answer: str) -> str:
    messages = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    return json.dumps({"messages": messages})


def test_a_chat_dataset_uploads_with_its_report_and_bad_lines_by_number(
    sft: Sft, tmp_path: Path
) -> None:
    chats = tmp_path / "chats.jsonl"
    lines = [_chat(f"What is {i} plus {i}?", f"It is {2 * i}.") for i in range(80)]
    chats.write_text("\n".join(lines) + "\n", encoding="utf-8")
    up = trainq(
        sft.env, "data", "upload", str(chats), "--name", "chats", "--format", "chat",
        "--max-len", "100", "--wait",
    )  # fmt: skip
    assert up.returncode == 0, up.stderr
    assert "dataset chats ready" in up.stdout
    assert "80 examples" in up.stdout and "carry loss" in up.stdout and "dropped: none" in up.stdout
    assert "\nlongest example " in up.stdout and "% of the rows are tokens" in up.stdout
    assert "\\x0a" not in up.stdout  # each line printed as a line, not escaped
    bad = tmp_path / "bad.jsonl"
    bad.write_text(_chat("fine", "ok") + "\n" + json.dumps({"messages": [{"role": "x"}]}) + "\n")
    refused = trainq(sft.env, "data", "upload", str(bad), "--name", "bad", "--format", "chat")
    assert refused.returncode == 6, refused.stderr
    assert "line 2: messages[0] has role" in refused.stderr
    # A line only the tokenizer's template refuses (found when preparing, on the server):
    # the dataset failed, one line naming it by number, a nonzero exit, no traceback.
    tok = f"chat-tok-strict-{uuid.uuid4().hex[:6]}"
    strict = "{% if 'robot' in messages[0].content %}{{ raise_exception('no robots') }}{% endif %}"
    _tokenizer(sft.data_root / tok, strict + TEMPLATE)
    robots = tmp_path / "robots.jsonl"
    robots.write_text(_chat("hi", "ok") + "\n" + _chat("a robot?", "no") + "\n")
    failed = trainq(
        sft.env, "data", "upload", str(robots), "--name", "robots", "--format", "chat",
        "--tokenizer", tok, "--wait",
    )  # fmt: skip
    assert failed.returncode == 1, (failed.stdout, failed.stderr)
    [line] = failed.stderr.splitlines()
    assert "dataset robots failed" in line and "line 2:" in line and "no robots" in line


def _tokenizer(folder: Path, template: str = TEMPLATE) -> int:
    """The Qwen2-shaped tokenizer of these conversations, ``template`` its chat template."""
    lines = [" ".join([*WORDS, "user", "bot", "?", "."])] * 20
    return qwen2_tokenizer(folder, lines, template, vocab_size=300, pad_token="<|im_end|>")


def _conversations(n: int) -> list[str]:
    colours, numbers = WORDS[:3], WORDS[3:8]
    out = []
    for i in range(n):
        if i % 2:
            out.append(_chat(f"what colour is {WORDS[8 + i % 4]} ?", f"{colours[i % 3]} ."))
        else:
            out.append(_chat(f"what number is {WORDS[8 + i % 4]} ?", f"{numbers[i % 5]} ."))
    return out


def test_conversations_fine_tuned_with_lora_serve_as_the_download_generates(
    sft: Sft, tmp_path: Path
) -> None:
    import openai
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tag = uuid.uuid4().hex[:6]
    vocab = _tokenizer(sft.data_root / f"chat-tok-{tag}")
    qwen2_model(sft.data_root / f"chat-qwen-{tag}", vocab, width=32, max_positions=128)
    chats = tmp_path / "convos.jsonl"
    chats.write_text("\n".join(_conversations(120)) + "\n", encoding="utf-8")
    up = trainq(
        sft.env, "data", "upload", str(chats), "--name", "convos", "--format", "chat",
        "--tokenizer", f"chat-tok-{tag}", "--wait",
    )  # fmt: skip
    assert up.returncode == 0, up.stderr
    assert "chat template: tokenizer" in up.stdout and "120 examples" in up.stdout

    train: dict[str, Any] = {
        "steps": 12,
        "seed": 3,
        "model": {"family": "hf", "path": f"chat-qwen-{tag}", "seq_len": 64},
        "data": {"dataset": "convos", "packing": True},
        "batch": {"micro_batch_size": 4},
        "optim": {"lr": 3e-2, "warmup_steps": 2},
        "lora": {"rank": 8, "alpha": 16.0},
        "eval": {"every": 0},
        "checkpoint": {"every": 12, "keep": 1, "hf": "final"},
    }
    done = sft.run_job({"name": "chat-lora", "train": train})
    job_id = str(done["id"])
    export = tmp_path / "export"
    with sft.api.client() as c:
        r = c.get(f"/v1/jobs/{job_id}/checkpoints/latest/download", params={"format": "hf"})
    assert r.status_code == 200, r.text
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
        tar.extractall(export, filter="data")

    question = [{"role": "user", "content": "what colour is sun ?"}]
    client = openai.OpenAI(base_url=f"{sft.api.url}/v1", api_key=str(sft.api.token),
                           max_retries=0, timeout=90)  # fmt: skip
    with client:
        answer = client.chat.completions.create(
            model=job_id,
            messages=question,
            max_tokens=12,
            temperature=0,  # type: ignore[arg-type]
        )
        twelve = client.chat.completions.create(
            model=job_id, messages=question, max_tokens=12, temperature=0,  # type: ignore[arg-type]
            extra_body={"ignore_eos": True},
        )  # fmt: skip

    tok = AutoTokenizer.from_pretrained(export, local_files_only=True)
    assert tok.chat_template == TEMPLATE  # the export carries the template it trained with
    prompt = tok.apply_chat_template(question, add_generation_prompt=True, return_tensors="pt")
    ids = prompt if isinstance(prompt, torch.Tensor) else prompt["input_ids"]
    assert tok.decode(ids[0]).endswith("<|im_start|>bot ")
    assert answer.usage is not None and answer.usage.prompt_tokens == ids.shape[1]
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        stops = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :]
        runs_on = model.generate(
            ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, eos_token_id=None
        )[0, ids.shape[1] :]
    # In the template's format: the answer ends its turn with the template's <|im_end|>.
    [choice] = answer.choices
    assert choice.finish_reason == "stop" and stops.tolist()[-1] == end
    assert choice.message.content == tok.decode(stops, skip_special_tokens=True)
    # Twelve greedy tokens past the end of turn: the same text (the route decodes special
    # tokens as text, as transformers with skip_special_tokens=False).
    assert twelve.usage is not None and twelve.usage.completion_tokens == 12
    assert runs_on.numel() == 12
    text = twelve.choices[0].message.content
    assert text and text == tok.decode(runs_on, skip_special_tokens=False)
