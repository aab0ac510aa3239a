"""Generation on a worker: requests from the Redis streams of the worker's queues, answered
on each request's reply stream (the wire: ``worker.genmessage``).

``GenerationServer`` runs its own threads (``TRAINQ_GENERATE_THREADS``, default 1) beside
Celery's training slots, so a busy slot never blocks generation. One reader thread is a
consumer of the group ``generate`` on every queue's request stream (one worker takes each
request) and keeps up to ``TRAINQ_GENERATE_BACKLOG`` requests in a ``FairQueue``
(``worker.genqueue``), from which the generation threads take them owner by owner in turn,
so one tenant's burst does not hold up another's request. A request is acked as it is read
(at most once: the API has its own deadline, so a request lost with a dying worker is a
504, never a hang); one still in the backlog when the worker stops is answered 503.

Requests to the same model decode together (``trainer.generate.Engine``): a generation
thread that takes a ``complete`` or ``chat`` request also takes the waiting requests for the
same (job, step), owner by owner, up to ``TRAINQ_GENERATE_BATCH``, and after each token
the waiting ones take the seats of those that ended (an ``hf`` model whose cache is not
plain ``DynamicLayer``s: only while its batch is empty). A thread steps up to
``MODELS_PER_THREAD`` such batches (models) a token each in turn. Each request keeps its
own parameters, seed, stop strings, deadline and cancel, and its ``start`` event says how
many requests it decodes with (``batch``).
``tokenize`` and ``detokenize`` are answered at once from the model's tokenizer; ``chat``
renders its messages with ``trainer.chat`` (``_chat_prompt``) and is then a completion.

Models are loaded from the job's checkpoint (``trainer.export.load_model``: any strategy,
LoRA merged) and kept in an LRU bounded by ``TRAINQ_GENERATE_CACHE_BYTES`` (weights and
buffers), so the next request to the same checkpoint starts at once; the load time is
reported in the ``start`` event. Every failure is an ``error`` event with an HTTP status:
no checkpoint 409, an unknown step 404, a checkpoint that cannot be loaded 409, a prompt
longer than the context 422, the deadline 504, anything else 500.

torch is imported by the generation threads only, when the first request arrives: a
worker that never generates never loads it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from worker.context import WorkerContext
from worker.genmessage import (
    FIELD,
    GROUP,
    GenerateRequest,
    cancel_key,
    encode_event,
    error_event,
    reply_stream,
    request_stream,
)
from worker.genqueue import FairQueue

__all__ = ["GenerateError", "GenerationServer", "ModelCache"]

log = logging.getLogger(__name__)

BLOCK_MS = 1000
REPLY_TTL_S = 120  # past the deadline, a reply nobody read expires
CANCEL_POLL_S = 0.25  # how often a streamed request looks for its cancel key
GENERATING = ("complete", "chat")  # the kinds that decode (and batch)
MODELS_PER_THREAD = 4  # batches (one per model) a generation thread decodes in turn
BACKLOG_FULL_WAIT_S = 0.05
# A new batch waits this long for requests that arrive with its first: a list of prompts, or
# clients sending at once, lands as stream entries a few milliseconds apart, and the reader
# wakes on the first. Decoded together their prefill is one forward; apart, the first runs
# alone while the rest wait for it.
GATHER_S = 0.004


class GenerateError(Exception):
    def __init__(self, status: int, message: str, loc: list[str | int] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.loc = status, message, loc


@dataclass
class Loaded:
    model: Any
    tokenizer: Any
    step: int
    nbytes: int
    load_s: float


def _checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    from trainer.checkpoint import DONE, checkpoint_dirs

    # A link planted in the run folder (the run folder, checkpoints/, a step-N or its DONE)
    # would load files from outside it: such a checkpoint is none, as the API lists it.
    if run_dir.is_symlink() or (run_dir / "checkpoints").is_symlink():
        return []
    found = checkpoint_dirs(run_dir)
    return [(s, p) for s, p in found if not p.is_symlink() and not (p / DONE).is_symlink()]


class ModelCache:
    """Loaded checkpoints, least recently used first out once over ``max_bytes``."""

    def __init__(
        self,
        runs_root: Path,
        data_root: Path,
        max_bytes: int,
        device: str,
        torch_threads: int | None = None,
    ) -> None:
        self.runs_root, self.data_root = runs_root, data_root
        self.max_bytes, self.device = max_bytes, device
        self.torch_threads = torch_threads
        self._models: OrderedDict[tuple[str, int, int], Loaded] = OrderedDict()
        self._lock = threading.Lock()

    def checkpoint(self, job_id: str, step: int | None) -> tuple[int, Path]:
        found = _checkpoints(self.runs_root / job_id)
        if not found:
            raise GenerateError(409, f"job {job_id} has no complete checkpoint yet")
        if step is None:
            return found[-1]
        for s, path in found:
            if s == step:
                return s, path
        have = ", ".join(str(s) for s, _ in found)
        raise GenerateError(404, f"job {job_id} has no checkpoint at step {step} ({have})")

    def get(self, job_id: str, step: int | None) -> tuple[Loaded, bool]:
        """The model of the job's checkpoint (its newest when ``step`` is None), and whether
        it was loaded already."""
        s, path = self.checkpoint(job_id, step)
        try:
            stamp = (path / "DONE").stat().st_mtime_ns  # a step rewritten by a new run
        except OSError:
            stamp = 0
        key = (job_id, s, stamp)
        with self._lock:  # one load at a time; a second request for it waits, then hits
            hit = self._models.get(key)
            if hit is not None:
                self._models.move_to_end(key)
                return hit, True
            loaded = self._load(job_id, path, s)
            self._models[key] = loaded
            while len(self._models) > 1 and self._total() > self.max_bytes:
                self._models.popitem(last=False)
            if self._total() > self.max_bytes:  # alone over the budget: used once, not kept
                self._models.pop(key, None)
            return loaded, False

    def _total(self) -> int:
        return sum(m.nbytes for m in self._models.values())

    def _load(self, job_id: str, path: Path, step: int) -> Loaded:
        import torch

        from trainer.config import ConfigError, frozen_data_path, load_config
        from trainer.export import ExportError, load_model
        from trainer.generate import load_tokenizer

        if self.torch_threads is not None and torch.get_num_threads() != self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        start = time.perf_counter()
        run_dir = self.runs_root / job_id
        try:
            cfg = load_config(run_dir / "config.json")
            tokenizer = load_tokenizer(frozen_data_path(cfg, self.data_root))
            model, _ = load_model(run_dir, path, merge=True)
        except (ExportError, ConfigError, OSError, ValueError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise GenerateError(409, f"checkpoint step {step} cannot be loaded: {first}") from exc
        model = model.to(self.device).eval()
        tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}.values()
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        return Loaded(model, tokenizer, step, nbytes, time.perf_counter() - start)


class GenerationServer:
    def __init__(self, ctx: WorkerContext) -> None:
        import redis

        self.ctx = ctx
        s = ctx.settings
        self.prefix = s.redis_prefix
        self.redis: Any = redis.Redis.from_url(
            s.redis_url, socket_timeout=BLOCK_MS / 1000 + 5, socket_connect_timeout=2
        )
        self.streams = {request_stream(q, self.prefix): ">" for q in ctx.queues}
        self.models = ModelCache(
            Path(s.runs_root),
            Path(s.data_root),
            s.generate_cache_bytes,
            s.generate_device,
            s.generate_torch_threads,
        )
        self.backlog: FairQueue[GenerateRequest] = FairQueue()
        self.backlog_max = s.generate_backlog
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        reader = threading.Thread(target=self._read, name="generate-read", daemon=True)
        reader.start()
        self._threads.append(reader)
        for i in range(self.ctx.settings.generate_threads):
            t = threading.Thread(target=self._run, args=(i,), name=f"generate-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(BLOCK_MS / 1000 + 2)
        for req in self.backlog.drain():  # taken but never started: answered, not dropped
            self._send(reply_stream(req.id, self.prefix), req,
                       error_event(503, "the worker is shutting down"))  # fmt: skip
        self.redis.close()

    def _groups(self) -> None:
        import redis

        for stream in self.streams:
            try:  # from the stream's start: requests sent before any worker came are served
                self.redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    def _read(self) -> None:
        """Take requests off the queues' streams into the backlog, up to its bound (what
        is past it stays in the stream for this or another worker)."""
        consumer = f"{self.ctx.name}-read"
        ready = False
        while not self._stop.is_set():
            room = self.backlog_max - len(self.backlog)
            if room <= 0:
                self._stop.wait(BACKLOG_FULL_WAIT_S)
                continue
            try:
                if not ready:
                    self._groups()
                    ready = True
                got = self.redis.xreadgroup(
                    GROUP, consumer, self.streams, count=room, block=BLOCK_MS
                )
            except Exception as exc:  # Redis away: try again shortly
                log.warning("generation: reading requests failed: %s", exc)
                ready = False
                self._stop.wait(1.0)
                continue
            for stream, entries in got or ():
                # One round trip acknowledges the whole read, and the backlog gets it at
                # once: requests a client sent together (a list of prompts) start together
                # instead of the first alone while the others are acknowledged one by one.
                try:
                    ids = [entry_id for entry_id, _ in entries]
                    with self.redis.pipeline(transaction=False) as pipe:
                        pipe.xack(stream, GROUP, *ids)
                        pipe.xdel(stream, *ids)
                        pipe.execute()
                except Exception as exc:
                    log.warning("generation: ack failed: %s", exc)
                taken: list[tuple[str, GenerateRequest]] = []
                for _, fields in entries:
                    try:
                        req = GenerateRequest.from_entry(fields)
                    except (ValidationError, ValueError, TypeError) as exc:
                        self._refuse(fields, exc)
                        continue
                    taken.append((req.owner, req))
                self.backlog.put_many(taken)

    def _run(self, index: int) -> None:
        """Take requests by owner's turn. With batching on, a generation thread decodes up
        to ``MODELS_PER_THREAD`` batches (one per model) a token each in turn, so a request
        for another model starts at once rather than after a whole batch."""
        size = self.ctx.settings.generate_batch
        batches: list[_Batch] = []
        while not self._stop.is_set():
            if size == 1 or len(batches) < MODELS_PER_THREAD:
                got = self.backlog.get(timeout=0 if batches else BLOCK_MS / 1000)
                if got is not None:
                    req = got[1]
                    if size == 1 or req.kind not in GENERATING:
                        self.answer(req)
                    else:
                        found = next((b for b in batches if b.key == (req.job_id, req.step)
                                      and b.engine.can_join and len(b.engine.live) < size),
                                     None)  # fmt: skip
                        if found is not None:
                            self._join(found, [req], True)
                        elif (found := self._open(req, size)) is not None:
                            batches.append(found)
            for found in batches:
                if found.engine.live:
                    self._step(found, size)
            batches = [b for b in batches if b.engine.live]
        for found in batches:  # stopping: what is still decoding is answered 503
            while found.engine.live:
                self._step(found, 1)

    # ------------------------------------------------------------------------- one request

    def serve(self, fields: dict[Any, Any]) -> None:
        """Answer one request entry as read from a stream."""
        try:
            req = GenerateRequest.from_entry(fields)
        except (ValidationError, ValueError, TypeError) as exc:
            self._refuse(fields, exc)
            return
        self.answer(req)

    def answer(self, req: GenerateRequest, batch: int = 1) -> None:
        """Answer ``req``; a generation takes up to ``batch`` - 1 waiting requests for the
        same model into its batch (owner by owner), and more join as seats free up."""
        if req.kind in GENERATING:
            self._decode(req, batch)
            return
        with self._answering(req):
            self._tokens(req)

    @contextmanager
    def _answering(self, req: GenerateRequest) -> Iterator[None]:
        """Any failure of ``req`` becomes its error event."""
        try:
            yield
        except GenerateError as exc:
            self._error(req, exc)
        except Exception as exc:
            log.exception("generation %s on job %s failed", req.id, req.job_id)
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            self._error(req, GenerateError(500, f"generation failed: {first}"))

    def _error(self, req: GenerateRequest, exc: GenerateError) -> None:
        self._send(reply_stream(req.id, self.prefix), req,
                   error_event(exc.status, exc.message, exc.loc))  # fmt: skip

    def _refuse(self, fields: dict[Any, Any], exc: Exception) -> None:
        """A request this worker cannot read (another version's API?): answered with an
        error when its id can be found, so the API does not wait out its deadline."""
        log.warning("generation: malformed request: %s", str(exc).splitlines()[0])
        try:
            raw = json.loads(fields.get(FIELD) or fields.get(FIELD.encode()) or "{}")
            reply = reply_stream(str(raw.get("id")), self.prefix)
        except (ValueError, TypeError, AttributeError):
            return  # nobody to answer
        event = error_event(500, f"the worker cannot read this request: {exc.__class__.__name__}")
        try:
            with self.redis.pipeline(transaction=False) as pipe:
                pipe.xadd(reply, encode_event(event))
                pipe.expire(reply, REPLY_TTL_S)
                pipe.execute()
        except Exception as err:
            log.warning("generation: reply failed: %s", err)

    def _send(self, reply: str, req: GenerateRequest, event: dict[str, Any]) -> None:
        self._send_all([(req, event)], reply)

    def _send_all(
        self, events: list[tuple[GenerateRequest, dict[str, Any] | None]], reply: str = ""
    ) -> None:
        """Each request's event onto its reply stream, all in one round trip (a batch's
        starts, or the ends of a step); None: nothing for that request."""
        sent = [(req, event) for req, event in events if event is not None]
        if not sent:
            return
        now = time.time()
        try:
            with self.redis.pipeline(transaction=False) as pipe:
                for req, event in sent:
                    stream = reply or reply_stream(req.id, self.prefix)
                    pipe.xadd(stream, encode_event(event))
                    pipe.expire(stream, max(1, int(req.deadline - now) + REPLY_TTL_S))
                pipe.execute()
        except Exception as exc:
            log.warning("generation: reply to %s failed: %s",
                        ", ".join(req.id for req, _ in sent), exc)  # fmt: skip

    def _late(self, req: GenerateRequest, what: str) -> None:
        if time.time() > req.deadline:
            raise GenerateError(504, f"the generation deadline passed {what}")

    def _model(self, req: GenerateRequest) -> tuple[Loaded, bool]:
        self._late(req, "before a worker took the request")
        loaded, cached = self.models.get(req.job_id, req.step)
        self._late(req, f"while loading the model ({loaded.load_s:.1f} s)")
        return loaded, cached

    def _start_event(
        self, loaded: Loaded, cached: bool, prompt: list[int], batch: int
    ) -> dict[str, Any]:
        from trainer.generate import context_length

        return {
            "type": "start",
            "worker": self.ctx.name,  # the API fails the request if this worker goes stale
            "step": loaded.step,
            "load_s": round(loaded.load_s, 4),
            "cached": cached,
            "prompt_tokens": len(prompt),
            "prompt_ids": prompt,
            "batch": batch,
            "context": context_length(loaded.model),
            "eos": list(getattr(loaded.tokenizer, "eos_ids", ())),
        }  # fmt: skip

    # ------------------------------------------------------------- tokenize and detokenize

    def _tokens(self, req: GenerateRequest) -> None:
        from trainer.generate import context_length

        loaded, cached = self._model(req)
        tok = loaded.tokenizer
        reply = reply_stream(req.id, self.prefix)
        # start and end in one round trip: the answer is at hand
        if req.kind == "tokenize":
            ids = tok.encode(req.prompt or "", add_special_tokens=req.add_special_tokens)
            end = {
                "type": "end",
                "tokens": ids,
                "count": len(ids),
                "max_model_len": context_length(loaded.model),
                "token_strs": [tok.token_str(t) for t in ids],
                "tokenizer": _tokenizer_info(tok),
            }  # fmt: skip
        else:
            ids = list(req.prompt_ids or [])
            _check_ids(ids, _vocab(loaded.model), ["body", "prompt_ids"])
            end = {"type": "end", "prompt": tok.decode(ids)}
        self._send_all([(req, self._start_event(loaded, cached, ids, 1)), (req, end)], reply)

    # ---------------------------------------------------------------------------- decoding

    def _decode(self, first: GenerateRequest, batch: int) -> None:
        """Decode ``first`` with the waiting requests for its model, alone on this thread."""
        found = self._open(first, batch)
        while found is not None and found.engine.live:
            self._step(found, batch)

    def _open(self, first: GenerateRequest, batch: int) -> _Batch | None:
        """A batch for ``first``'s model with the waiting requests that fit it (owner by
        owner); None when the model cannot be had (each request answered)."""
        key = (first.job_id, first.step)
        if batch > 1 and len(self.backlog) < batch - 1:
            self._stop.wait(GATHER_S)
        members = [first] + [r for _, r in self.backlog.take(_fits(key), batch - 1)]
        try:
            loaded, cached = self._model(first)
        except Exception as exc:
            for req in members:
                with self._answering(req):
                    raise exc
            return None
        from trainer.generate import Engine

        found = _Batch(key, Engine(loaded.model, loaded.tokenizer), loaded)
        self._join(found, members, cached)
        return found

    def _step(self, found: _Batch, batch: int) -> None:
        """One token for every request of ``found``; requests that ended are answered, and
        waiting ones for its model take the seats they left."""
        engine = found.engine
        try:
            ended = engine.step()
        except Exception as exc:  # the batch's forward failed: every request in it
            for live in engine.live:
                with self._answering(found.serving[id(live.req)].req):
                    raise exc
            engine.live.clear()
            return
        self._send_all([self._end(found.serving.pop(id(gen)), found.loaded) for gen in ended])
        room = batch - len(engine.live)
        if room > 0 and engine.live and engine.can_join and not self._stop.is_set():
            self._join(found, [r for _, r in self.backlog.take(_fits(found.key), room)], True)

    def _join(self, found: _Batch, reqs: list[GenerateRequest], cached: bool) -> None:
        engine, serving, loaded = found.engine, found.serving, found.loaded
        ready: list[_Serving] = []
        for req in reqs:
            with self._answering(req):
                ready.append(self._prepare(req, loaded))
        if not ready:
            return
        for item in ready:
            serving[id(item.gen)] = item
        try:
            ended = engine.add([item.gen for item in ready])
        except Exception as exc:
            for item in ready:
                serving.pop(id(item.gen), None)
                with self._answering(item.req):
                    raise exc
            return
        self._send_all([
            (item.req, self._start_event(loaded, cached, item.prompt, item.gen.batch))
            for item in ready
        ])  # fmt: skip
        self._send_all([self._end(serving.pop(id(gen)), loaded) for gen in ended])

    def _prepare(self, req: GenerateRequest, loaded: Loaded) -> _Serving:
        """The engine's request for ``req``: its prompt checked, its parameters, its
        deadline and cancel checks, its deltas."""
        from trainer.generate import GenerationStopped, Request, Sampling, context_length

        self._late(req, "before decoding began")
        model, tok = loaded.model, loaded.tokenizer
        if req.kind == "chat":
            prompt = tok.encode(_chat_prompt(req, loaded), add_special_tokens=False)
        elif req.prompt is not None:
            prompt = tok.encode(req.prompt)
        else:
            prompt = list(req.prompt_ids or [])
        if not prompt:
            raise GenerateError(422, "the prompt is empty", ["body", "prompt"])
        loc: list[str | int] = ["body", "messages" if req.kind == "chat" else "prompt"]
        _check_ids(prompt, _vocab(model), loc)
        _check_ids(list(req.logit_bias), _vocab(model), ["body", "logit_bias"])
        limit = context_length(model)
        if len(prompt) > limit:
            raise GenerateError(
                422, f"the prompt is {len(prompt)} tokens; the model's context is {limit}", loc
            )
        params = Sampling(
            max_tokens=req.max_tokens,
            temperature=req.temperature,
            top_k=req.top_k,
            top_p=req.top_p,
            seed=req.seed,
            stop=tuple(s for s in req.stop if s),
            n=req.n,
            logprobs=req.logprobs,
            echo=req.echo,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            logit_bias=tuple(sorted(req.logit_bias.items())),
            eos=() if req.ignore_eos else tuple(getattr(tok, "eos_ids", ())),
        )
        reply = reply_stream(req.id, self.prefix)
        cancel = cancel_key(req.id, self.prefix)
        polled = [time.monotonic()]

        def check(done: int) -> None:
            if time.time() > req.deadline or self._stop.is_set():
                raise GenerationStopped(f"the deadline passed after {done} tokens")
            if req.stream and time.monotonic() - polled[0] > CANCEL_POLL_S:
                polled[0] = time.monotonic()
                if self.redis.exists(cancel):  # the client went away
                    raise GenerationStopped(f"the client went away after {done} tokens")

        def delta(items: list[Any]) -> None:
            self._send(reply, req, {"type": "delta", "choices": items})

        gen = Request(prompt, params, delta if req.stream else None, check)
        return _Serving(req, gen, prompt)

    def _end(self, item: _Serving, loaded: Loaded) -> tuple[GenerateRequest, dict[str, Any] | None]:
        """The request's end event (None when it ended in an error, answered here)."""
        req, gen = item.req, item.gen
        if gen.error is not None:
            exc = gen.error
            with self._answering(req):
                if self._stop.is_set():
                    raise GenerateError(503, f"the worker is shutting down: stopped {exc}")
                raise GenerateError(504, f"generation stopped: {exc}")
            return req, None
        result = gen.result
        assert result is not None
        gen_s = time.perf_counter() - item.began
        event = {
            "type": "end",
            "choices": [
                {
                    "index": c.index,
                    "text": c.text,
                    "token_ids": c.token_ids,
                    "finish_reason": c.finish_reason,
                    "logprobs": c.logprobs,
                }
                for c in result.choices
            ],
            "usage": {
                "prompt_tokens": result.prompt_tokens,
                "completion_tokens": result.completion_tokens,
                "total_tokens": result.prompt_tokens + result.completion_tokens,
            },
            "seed": result.seed,
            "generate_s": round(gen_s, 4),
            "prompt_text": result.prompt_text,
            "prompt_logprobs": result.prompt_logprobs,
        }  # fmt: skip
        log.info("generation %s: job %s step %d, %d tokens in %.2f s (batch %d)", req.id,
                 req.job_id, loaded.step, result.completion_tokens, gen_s, gen.batch)  # fmt: skip
        return req, event


@dataclass
class _Batch:
    """Requests to one model decoding together on a generation thread."""

    key: tuple[str, int | None]  # (job, step) as requested
    engine: Any  # trainer.generate.Engine
    loaded: Loaded
    serving: dict[int, _Serving] = field(default_factory=dict)  # by id() of the engine's


def _fits(key: tuple[str, int | None]) -> Callable[[GenerateRequest], bool]:
    def fits(r: GenerateRequest) -> bool:
        return r.kind in GENERATING and (r.job_id, r.step) == key

    return fits


@dataclass
class _Serving:
    """A request being decoded: the wire's request, the engine's, its prompt ids."""

    req: GenerateRequest
    gen: Any  # trainer.generate.Request
    prompt: list[int]
    began: float = field(default_factory=time.perf_counter)


def _vocab(model: Any) -> int:
    return int(getattr(model.cfg, "vocab_size", 0) or model.vocab_size)


def _check_ids(ids: list[int], vocab: int, loc: list[str | int]) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise GenerateError(422, f"token id {bad} is outside the vocabulary ({vocab})", loc)


def _chat_prompt(req: GenerateRequest, loaded: Loaded) -> str:
    """``req.messages`` rendered with a chat template (``trainer.chat``): the request's
    ``chat_template``, else the tokenizer's own, else ``trainer.chat.DEFAULT_TEMPLATE``
    (ChatML), in ``trainer.chat_sandbox``'s child process (a template may burn CPU or
    memory; the worker must not). A template that fails, or overruns that child's time or
    memory, is the request's 422, naming ``chat_template`` when the request sent it, else
    ``messages`` (the tokenizer's template refused them)."""
    from trainer.chat import DEFAULT_TEMPLATE, ChatTemplateError
    from trainer.chat_sandbox import render_isolated

    tok = loaded.tokenizer
    own = getattr(tok, "chat_template", None)
    template = req.chat_template or own or DEFAULT_TEMPLATE
    bos = getattr(tok, "bos_token", None) or ""
    eos = getattr(tok, "eos_token", None) or ""
    field = "chat_template" if req.chat_template else "messages"
    try:
        text = render_isolated(
            template, list(req.messages or []), req.add_generation_prompt, bos, eos
        )
    except ChatTemplateError as exc:
        raise GenerateError(422, str(exc), ["body", field]) from None
    if not text:  # the body has no prompt to name: what rendered to nothing
        raise GenerateError(422, "the chat template renders an empty prompt", ["body", field])
    return text


def _tokenizer_info(tok: Any) -> dict[str, Any]:
    """What ``/tokenizer_info`` tells of ``tok``: its special tokens (None where it has
    none: bytes have none) and the chat template the chat route renders with (its own, else
    trainq's default), so a client that renders chats itself renders them the same."""
    from trainer.chat import DEFAULT_TEMPLATE

    return {
        "bos_token": getattr(tok, "bos_token", None),
        "eos_token": getattr(tok, "eos_token", None),
        "pad_token": getattr(tok, "pad_token", None),
        "chat_template": getattr(tok, "chat_template", None) or DEFAULT_TEMPLATE,
    }
