"""A real worker batches concurrent generation requests to one model: requests sent
together through its Redis request stream report ``batch`` > 1 in their ``start`` events,
and each answer (greedy tokens, log-probabilities) is the one the request gets alone.

The model is a tiny run the worker itself trains (bytes, gpt); requests go on the wire the
way the API sends them (worker.genmessage), answers are read from their reply streams."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from tests.worker.conftest import Wire, message, tiny
from worker.genmessage import GenerateRequest, decode_event, reply_stream, request_stream

pytestmark = pytest.mark.timeout(240)

PROMPTS = ["Once upon a time", "ab", "The quick brown fox jumps", "z", "Hello, world", "0123"]
OWNERS = ["aa", "bb"]


def request(job_id: str, prompt: str, owner: str) -> GenerateRequest:
    return GenerateRequest(
        id=uuid.uuid4().hex, job_id=job_id, owner=owner, prompt=prompt, max_tokens=24,
        temperature=0, logprobs=2, echo=True, deadline=time.time() + 120,
    )  # fmt: skip


def answers(wire: Wire, reqs: list[GenerateRequest]) -> dict[str, list[dict[str, Any]]]:
    """Each request's events, up to its end or error."""
    events: dict[str, list[dict[str, Any]]] = {r.id: [] for r in reqs}
    last = {reply_stream(r.id): "0" for r in reqs}
    deadline = time.time() + 120
    while any(not e or e[-1]["type"] not in ("end", "error") for e in events.values()):
        assert time.time() < deadline, events
        got = wire.r.xread(last, block=500)
        for stream, entries in got or ():
            name = stream.decode()
            for entry_id, fields in entries:
                last[name] = entry_id
                events[name.rsplit(":", 1)[1]].append(decode_event(fields))
    return events


def test_concurrent_requests_are_decoded_together_and_each_gets_its_own_answer(
    start_worker: Callable[..., Any], wire: Wire
) -> None:
    start_worker("w1", generate_batch=8)
    job_id = uuid.uuid4().hex[:12]
    wire.send(message(job_id, procs=1, train=tiny(steps=10)))
    done = wire.exited(job_id, 1, timeout=180)
    assert (done["reason"], done["exit_code"]) == (None, 0), done
    stream = request_stream("cpu")

    together = [request(job_id, p, OWNERS[i % 2]) for i, p in enumerate(PROMPTS)]
    with wire.r.pipeline(transaction=False) as pipe:
        for r in together:
            pipe.xadd(stream, r.to_entry())
        pipe.execute()
    batched = answers(wire, together)

    alone = {}
    for r in together:  # one at a time: nothing to batch with
        again = request(job_id, r.prompt or "", r.owner)
        wire.r.xadd(stream, again.to_entry())
        alone[r.id] = answers(wire, [again])[again.id]

    batches = []
    for r in together:
        start, end = batched[r.id][0], batched[r.id][-1]
        assert start["type"] == "start" and end["type"] == "end", batched[r.id]
        assert start["prompt_ids"] == list(r.prompt.encode())  # type: ignore[union-attr]
        assert start["context"] == 32 and start["eos"] == []
        batches.append(start["batch"])
        single = alone[r.id]
        assert single[0]["batch"] == 1
        [a], [b] = single[-1]["choices"], end["choices"]
        assert b["token_ids"] == a["token_ids"] and len(b["token_ids"]) > 0
        for ra, rb in zip(a["logprobs"], b["logprobs"], strict=True):
            assert ra["id"] == rb["id"] and abs(ra["logprob"] - rb["logprob"]) < 1e-4
        assert end["prompt_text"] == r.prompt
        assert end["prompt_logprobs"][0] is None
        assert len(end["prompt_logprobs"]) == len(start["prompt_ids"])
    assert max(batches) > 1, batches

    # tokenize and detokenize, answered by the same worker from the loaded model's tokenizer
    text = "héllo 😀"
    tokenize = GenerateRequest(id=uuid.uuid4().hex, job_id=job_id, kind="tokenize", prompt=text,
                               deadline=time.time() + 60)  # fmt: skip
    wire.r.xadd(stream, tokenize.to_entry())
    end = answers(wire, [tokenize])[tokenize.id][-1]
    assert end["tokens"] == list(text.encode()) and end["count"] == len(text.encode())
    assert end["max_model_len"] == 32 and end["token_strs"][0] == "h"
    assert end["token_strs"][1] == "bytes:\\xc3"
    back = GenerateRequest(id=uuid.uuid4().hex, job_id=job_id, kind="detokenize",
                           prompt_ids=end["tokens"], deadline=time.time() + 60)  # fmt: skip
    wire.r.xadd(stream, back.to_entry())
    assert answers(wire, [back])[back.id][-1] == {"type": "end", "prompt": text}
