"""The OpenAI-compatible surface end to end, with the real ``openai`` SDK: a tiny job trained
by a real worker, then models, completions (a list of prompts, logprobs, echo), chat
(plain and streamed) and the tokenizer routes, generated on that worker.

One system for the module (``fast_system``: the API with auth on, PostgreSQL, Redis, one
Celery worker) and one tiny byte-level training run shared by every test. Log-probabilities
are checked against a forward pass of the same checkpoint here (``trainer.export``), chat
against a completion of the prompt ``trainer.chat`` renders.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.system import Api, System, create_token, wait_for

pytestmark = pytest.mark.timeout(180)

QUEUE = "oai"
SEQ_LEN = 128  # room for a chat prompt in ChatML, byte by byte
TRAIN: dict[str, Any] = {
    "steps": 20,
    "seed": 5,
    "model": {"n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": SEQ_LEN, "vocab_size": 256},
    "data": {"path": "demo"},
    "batch": {"micro_batch_size": 4},
    "optim": {"lr": 1e-2, "warmup_steps": 2},
    "eval": {"every": 0},
    "checkpoint": {"every": 10, "keep": 2},
    "log_every": 5,
}
PROMPTS = ["The king said ", "Once upon a time"]
TOL = 1e-4


class Oai:
    def __init__(self, system: System, api: Api, other: Api, job_id: str) -> None:
        self.system, self.api, self.other, self.job_id = system, api, other, job_id
        self.runs_root = Path(system.env["TRAINQ_RUNS_ROOT"])
        self.client = openai.OpenAI(base_url=f"{api.url}/v1", api_key=str(api.token),
                                    max_retries=0, timeout=60)  # fmt: skip
        self.other_client = openai.OpenAI(base_url=f"{api.url}/v1", api_key=str(other.token),
                                          max_retries=0, timeout=60)  # fmt: skip
        self._model: Any = None

    def log_softmax(self, ids: list[int]) -> Any:
        """[len(ids), vocab] log-probabilities of a forward pass of the job's checkpoint."""
        import torch

        from trainer.export import load_model

        if self._model is None:
            self._model, _ = load_model(self.runs_root / self.job_id)
            self._model.eval()
        with torch.no_grad():
            logits = self._model(torch.tensor([ids]))
        return torch.log_softmax(logits.float(), dim=-1)[0]

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        with self.api.client() as c:
            return c.post(path, json=body, timeout=60)


@pytest.fixture(scope="module")
def oai(fast_system: System) -> Iterator[Oai]:
    api = fast_system.start_api(auth=True)
    db = fast_system.env["TRAINQ_DATABASE_URL"]
    api.token = create_token(db, "oai-user")
    other = Api(api.url, api.proc, create_token(db, "oai-other"))
    fast_system.start_worker(QUEUE, name="oai-worker")
    body = {"name": "oai-tiny", "queue": QUEUE, "procs_per_node": 1, "train": TRAIN}
    with api.client() as c:
        r = c.post("/v1/jobs", json=body)
        assert r.status_code == 201, r.text
        job_id = str(r.json()["id"])

        def done() -> bool:
            status = c.get(f"/v1/jobs/{job_id}").json()["status"]
            assert status in ("queued", "running", "succeeded"), status
            return status == "succeeded"

        wait_for(done, 120, "the tiny training run", every=0.3)
    oai = Oai(fast_system, api, other, job_id)
    yield oai
    oai.client.close()
    oai.other_client.close()


def test_models_list_and_retrieve(oai: Oai) -> None:
    ids = [m.id for m in oai.client.models.list()]
    assert ids == [oai.job_id, f"{oai.job_id}:20", f"{oai.job_id}:10"]
    card = oai.client.models.retrieve(f"{oai.job_id}:10")
    assert card.owned_by == "oai-user" and card.object == "model" and card.created > 0
    assert card.model_extra and card.model_extra["max_model_len"] == SEQ_LEN
    assert list(oai.other_client.models.list()) == []
    with pytest.raises(openai.NotFoundError) as err:
        oai.other_client.models.retrieve(oai.job_id)
    assert err.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        oai.other_client.completions.create(model=oai.job_id, prompt="a", max_tokens=1)


def test_completion_logprobs_are_the_checkpoints_own(oai: Oai) -> None:
    prompt = list(PROMPTS[0].encode())
    r = oai.client.completions.create(
        model=oai.job_id, prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=5
    )
    [choice] = r.choices
    ids = choice.model_extra["token_ids"] if choice.model_extra else []
    assert len(ids) == 8 and choice.finish_reason == "length"
    assert r.usage and r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 8
    lp = choice.logprobs
    assert lp is not None and lp.token_logprobs and lp.top_logprobs and lp.text_offset
    full = oai.log_softmax(prompt + ids)
    for i, token in enumerate(ids):
        row = full[len(prompt) + i - 1]
        assert abs(lp.token_logprobs[i] - float(row[token])) < TOL, i
        assert int(row.argmax()) == token, "greedy takes the most likely token"
        top = lp.top_logprobs[i]
        assert 5 <= len(top) <= 6 and max(top.values()) == pytest.approx(float(row.max()), abs=TOL)
        best = sorted(row.tolist(), reverse=True)[:5]
        assert sorted(top.values(), reverse=True)[:5] == pytest.approx(best, abs=TOL)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert lp.tokens and "".join(lp.tokens) == choice.text


def test_echo_with_max_tokens_0_scores_a_list_of_prompts(oai: Oai) -> None:
    """lm-eval's loglikelihood request: the prompts' own log-probabilities, nothing new."""
    r = oai.client.completions.create(
        model=oai.job_id, prompt=PROMPTS, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage and r.usage.completion_tokens == 0
    assert r.usage.prompt_tokens == sum(len(p.encode()) for p in PROMPTS)
    for text, choice in zip(PROMPTS, r.choices, strict=True):
        assert choice.text == text
        lp = choice.logprobs
        assert lp is not None and lp.token_logprobs is not None and lp.tokens is not None
        ids = list(text.encode())
        assert len(lp.token_logprobs) == len(ids) and lp.token_logprobs[0] is None
        assert lp.top_logprobs is not None and lp.top_logprobs[0] is None
        assert "".join(lp.tokens) == text
        full = oai.log_softmax(ids)
        for i in range(1, len(ids)):
            assert abs(lp.token_logprobs[i] - float(full[i - 1, ids[i]])) < TOL, i
    # Streamed with echo and new tokens: each choice whole (prompt, then completion), once.
    plain = oai.client.completions.create(
        model=oai.job_id, prompt=PROMPTS, max_tokens=3, echo=True, logprobs=0, temperature=0
    )
    stream = oai.client.completions.create(
        model=oai.job_id, prompt=PROMPTS, max_tokens=3, echo=True, logprobs=0, temperature=0,
        stream=True,
    )  # fmt: skip
    texts: dict[int, str] = {}
    logprobs: dict[int, list[Any]] = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.logprobs is not None and c.logprobs.token_logprobs:
                logprobs.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
    assert texts == {c.index: c.text for c in plain.choices}
    assert all(texts[i].startswith(p) for i, p in enumerate(PROMPTS))
    for c in plain.choices:
        assert c.logprobs and c.logprobs.token_logprobs and c.logprobs.token_logprobs[0] is None
        # batched with other requests (padding): the same within float error
        assert c.logprobs.token_logprobs[1:] == pytest.approx(logprobs[c.index][1:], abs=TOL)
        assert logprobs[c.index][0] is None
        assert len(logprobs[c.index]) == len(PROMPTS[c.index].encode()) + 3


def test_a_list_of_prompts_is_one_choice_per_prompt_and_n_in_order(oai: Oai) -> None:
    singles = [
        oai.client.completions.create(model=oai.job_id, prompt=p, max_tokens=6, temperature=0)
        .choices[0]
        .text
        for p in PROMPTS
    ]
    r = oai.client.completions.create(
        model=oai.job_id, prompt=PROMPTS, max_tokens=6, temperature=0, n=2
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [singles[0], singles[0], singles[1], singles[1]]
    assert r.usage and r.usage.completion_tokens == 4 * 6
    # Token-id prompts, streamed: the chunks of each index concatenate to the same texts.
    ids = [list(p.encode()) for p in PROMPTS]
    stream = oai.client.completions.create(
        model=oai.job_id, prompt=ids, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert texts == {0: singles[0], 1: singles[1]} and finish == {0: "length", 1: "length"}
    assert usage is not None and usage.completion_tokens == 12


def test_chat_renders_the_template_and_streams(oai: Oai) -> None:
    from trainer.chat import render

    messages: list[Any] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
    ]
    r = oai.client.chat.completions.create(
        model=oai.job_id, messages=messages, max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=2,
    )  # fmt: skip
    [choice] = r.choices
    assert r.object == "chat.completion" and choice.message.role == "assistant"
    rendered = render(None, [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "Hi"}])  # fmt: skip
    assert rendered.endswith("<|im_start|>assistant\n")
    same = oai.client.completions.create(
        model=oai.job_id, prompt=rendered, max_tokens=6, temperature=0
    )
    assert choice.message.content == same.choices[0].text
    assert r.usage and r.usage.prompt_tokens == len(rendered.encode())
    assert choice.logprobs and choice.logprobs.content and len(choice.logprobs.content) == 6
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    stream = oai.client.chat.completions.create(
        model=oai.job_id, messages=messages, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == choice.message.content
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == r.usage


def test_tokenize_and_detokenize_round_trip(oai: Oai) -> None:
    text = "héllo, wörld ✓"
    r = oai.post("/tokenize", {"model": oai.job_id, "prompt": text})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == list(text.encode()) and body["count"] == len(text.encode())
    assert body["max_model_len"] == SEQ_LEN
    back = oai.post(f"/models/{oai.job_id}/detokenize", {"tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}
    same = oai.post(f"/models/{oai.job_id}/tokenize", {"prompt": text, "add_special_tokens": False})
    assert same.json()["tokens"] == body["tokens"]


def test_lm_evals_remote_tokenizer_uses_a_models_base_url(oai: Oai) -> None:
    from lm_eval.utils import RemoteTokenizer

    base = f"{oai.api.url}/models/{oai.job_id}/v1/completions"  # what lm-eval's base_url is
    remote = RemoteTokenizer(base, auth_token=str(oai.api.token), max_retries=1)
    text = "Once upon a time ✓"
    assert remote.encode(text) == list(text.encode())
    assert remote.batch_decode([list(text.encode()), [72, 105]]) == [text, "Hi"]
    info = remote.tokenizer_info
    assert info["model_max_length"] == SEQ_LEN
    assert info["eos_token"] is None and remote.eos_token_id is None, "bytes have no EOS"
    # the template the chat route renders with, so lm-eval's own rendering of a chat matches
    from trainer.chat import DEFAULT_TEMPLATE, render

    chat = [{"role": "user", "content": "Hi ✓"}]
    assert info["chat_template"] == DEFAULT_TEMPLATE
    assert remote.apply_chat_template(chat) == render(DEFAULT_TEMPLATE, chat)


def test_bad_parameters_carry_param_and_code(oai: Oai) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        oai.client.completions.create(model=oai.job_id, prompt="x" * (SEQ_LEN + 1))
    assert err.value.param == "prompt" and "context" in err.value.message
    assert err.value.code == "invalid_value" and err.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as err:  # the worker's check: the vocabulary
        oai.client.completions.create(model=oai.job_id, prompt=[[1, 2], [3, 300]], max_tokens=1)
    assert err.value.param == "prompt[1]", err.value.param
    with pytest.raises(openai.BadRequestError) as err:
        oai.client.chat.completions.create(
            model=oai.job_id, messages=[{"role": "user", "content": "a"}],
            extra_body={"chat_template": "{{ raise_exception('no users here') }}"},
        )  # fmt: skip
    assert "no users here" in err.value.message and err.value.param == "chat_template"
    with pytest.raises(openai.BadRequestError) as err:  # a chat has no "prompt" to name
        oai.client.chat.completions.create(
            model=oai.job_id, messages=[{"role": "user", "content": "x" * (SEQ_LEN + 1)}]
        )
    assert err.value.param == "messages" and "context" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:  # burns CPU: stopped, the worker lives
        oai.client.chat.completions.create(
            model=oai.job_id, messages=[{"role": "user", "content": "a"}],
            extra_body={"chat_template": "{{ (9**9)**(9**9) }}"},
        )  # fmt: skip
    assert err.value.param == "chat_template" and "longer than" in err.value.message
    assert oai.client.completions.create(model=oai.job_id, prompt="a", max_tokens=1).choices
    with pytest.raises(openai.BadRequestError) as err:  # the worker knows the vocabulary
        oai.client.completions.create(model=oai.job_id, prompt="a", logit_bias={"300": 5})
    assert err.value.param == "logit_bias" and "vocabulary" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:  # what one call may cost: prompts x n
        oai.client.completions.create(model=oai.job_id, prompt=["a"] * 64, n=16, max_tokens=1)
    assert err.value.param == "n" and "1024 sequences" in err.value.message


def test_lm_evals_local_completions_scores_as_the_checkpoint(
    oai: Oai, monkeypatch: pytest.MonkeyPatch
) -> None:
    """lm-eval's own client (``local-completions``, remote tokenizer, batches of prompts):
    each continuation's log-likelihood is the checkpoint's, and greedy is the argmax."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    monkeypatch.setenv("OPENAI_API_KEY", str(oai.api.token))  # what its completions send
    lm = LocalCompletionsAPI(
        base_url=f"{oai.api.url}/models/{oai.job_id}/v1/completions",
        model=oai.job_id,
        tokenizer_backend="remote",
        auth_token=str(oai.api.token),
        batch_size=3,
        max_retries=1,
        max_length=SEQ_LEN,
    )
    pairs = [("The king said", " yes"), ("The king said", " no"), ("Once upon", " a time"),
             ("A", "B")]  # fmt: skip
    requests = [
        Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i)
        for i, pair in enumerate(pairs)
    ]
    got = lm.loglikelihood(requests, disable_tqdm=True)
    for (context, continuation), (loglik, greedy) in zip(pairs, got, strict=True):
        ctx, cont = list(context.encode()), list(continuation.encode())
        full = oai.log_softmax(ctx + cont)
        rows = [full[len(ctx) + i - 1] for i in range(len(cont))]
        expected = sum(float(row[t]) for row, t in zip(rows, cont, strict=True))
        assert abs(loglik - expected) < TOL * len(cont), (context, continuation)
        assert greedy == all(int(row.argmax()) == t for row, t in zip(rows, cont, strict=True))


def test_a_list_longer_than_the_owners_cap_runs_within_it(oai: Oai) -> None:
    """TRAINQ_GENERATE_MAX_PER_OWNER 1: a list of three prompts holds the one slot, all
    answered, each as it is alone."""
    oai.system.env["TRAINQ_GENERATE_MAX_PER_OWNER"] = "1"
    try:
        narrow = oai.system.start_api(auth=True)
    finally:
        del oai.system.env["TRAINQ_GENERATE_MAX_PER_OWNER"]
    client = openai.OpenAI(base_url=f"{narrow.url}/v1", api_key=str(oai.api.token),
                           max_retries=0, timeout=60)  # fmt: skip
    try:
        prompts = [*PROMPTS, "A"]
        r = client.completions.create(model=oai.job_id, prompt=prompts, max_tokens=4,
                                      temperature=0, logprobs=0)  # fmt: skip
        assert [c.index for c in r.choices] == [0, 1, 2]
        assert r.usage and r.usage.completion_tokens == 12
        singles = [
            oai.client.completions.create(model=oai.job_id, prompt=p, max_tokens=4, temperature=0)
            for p in prompts
        ]
        assert [c.text for c in r.choices] == [s.choices[0].text for s in singles]
    finally:
        client.close()
        narrow.proc.stop()
