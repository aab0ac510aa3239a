"""One OpenAI call as several worker requests (a completions call with a list of prompts:
one ``GenerateRequest`` per prompt), at most ``slots`` on the wire at a time
(``TRAINQ_GENERATE_FANOUT``; the call holds one in-flight slot,
``service.api.generation.inflight``).

The call's requests travel together: the ones that can go are appended to the queue's
request stream in one pipeline (the worker reads them in one read and decodes them as one
batch), and one XREAD over every open reply stream reads their events (a call of 8 prompts
used to cost 8 XADDs, 8 blocking XREADs on 8 connections and 8 DELs, each its own round
trip and task). ``Fanout.events()`` yields the events as they come, each tagged with its
request's position; the first error of any request ends the call and is raised (its HTTP
answer): a worker's error event, the deadline (504), the worker leaving the registry (502)
or Redis failing (503). Every reply stream is dropped however the call ends, and the
worker is told to stop what the client no longer waits for, in one round trip.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncGenerator
from typing import Any

from redis import RedisError

from service.api.core.deps import Services
from service.api.core.errors import InvalidInput
from service.api.generation.inflight import GRACE_S
from service.api.generation.service import (
    LIVENESS_S,
    REQUEST_STREAM_MAXLEN,
    Relay,
    Target,
    check_served,
    redis_lost,
)
from worker.genmessage import GenerateRequest, request_stream

__all__ = ["Fanout"]


class Fanout:
    def __init__(
        self,
        services: Services,
        target: Target,
        requests: list[GenerateRequest],
        slots: int,
        prompt_locs: list[list[str | int]] | None = None,
    ) -> None:
        self.services, self.target, self.requests = services, target, requests
        self.slots = max(1, min(slots, len(requests)))
        # each request's prompt as the body names it (``prompt[2]``): a worker's 422 about
        # "the prompt" names the one it is about
        self.prompt_locs = prompt_locs

    async def events(self) -> AsyncGenerator[tuple[int, dict[str, Any]], None]:
        """``(request position, event)`` until every request has ended."""
        relays = [Relay(self.services, self.target, r) for r in self.requests]
        waiting = deque(range(len(relays)))
        sent: list[int] = []
        try:
            await check_served(self.services, self.target.queue)
            open_: dict[str, int] = {}  # reply stream: request position
            looked = time.monotonic()
            while waiting or open_:
                going = []
                while waiting and len(open_) < self.slots:
                    k = waiting.popleft()
                    going.append(k)
                    open_[relays[k].reply] = k
                if going:
                    await self._send([relays[k] for k in going])
                    sent.extend(going)
                if time.monotonic() - looked >= LIVENESS_S:
                    looked = time.monotonic()
                    live = await self.services.alive_workers()
                    for k in open_.values():
                        if (lost := relays[k].lost(live)) is not None:
                            raise lost
                got = await self._read(relays, open_)
                for k in {k for k, _ in got if relays[k].done}:
                    del open_[relays[k].reply]
                for k, event in got:
                    yield k, event
        except RedisError as exc:
            raise redis_lost(exc) from exc
        finally:
            await self._close([relays[k] for k in sent])

    async def _send(self, relays: list[Relay]) -> None:
        stream = request_stream(self.target.queue, self.services.settings.redis_prefix)
        async with self.services.aredis.pipeline(transaction=False) as pipe:
            for relay in relays:
                pipe.xadd(stream, relay.request.to_entry(), maxlen=REQUEST_STREAM_MAXLEN,
                          approximate=True)  # fmt: skip
            await pipe.execute()

    async def _read(self, relays: list[Relay], open_: dict[str, int]) -> list[tuple[int, Any]]:
        """The events that arrived on the open reply streams (blocking up to the liveness
        period, so a lost worker is seen between reads); raises the first error's answer,
        or the timeout's once the earliest deadline (plus a grace) has passed."""
        ends_at = min(relays[k].request.deadline for k in open_.values()) + GRACE_S
        left = ends_at - time.time()
        if left <= 0:
            raise relays[next(iter(open_.values()))].timeout()
        block_ms = int(min(self.services.settings.sse_ping_s, LIVENESS_S) * 1000)
        block = max(1, min(block_ms, int(left * 1000)))
        cursors = {stream: relays[k].cursor for stream, k in open_.items()}
        got = await self.services.aredis.xread(cursors, count=100, block=block)
        out: list[tuple[int, Any]] = []
        for stream, entries in got or ():
            k = open_[stream.decode() if isinstance(stream, bytes) else stream]
            for entry_id, fields in entries:
                if relays[k].done:
                    break
                try:
                    out.append((k, relays[k].take(entry_id, fields)))
                except Exception as exc:
                    raise self._located(k, exc) from None
        return out

    async def _close(self, relays: list[Relay]) -> None:
        """Drop the reply streams; tell the worker to stop the requests not answered."""
        if not relays:
            return
        ttl = int(self.services.settings.generate_timeout_s) + 60
        try:
            async with self.services.aredis.pipeline(transaction=False) as pipe:
                for relay in relays:
                    if not relay.done:
                        pipe.set(relay.cancel, b"1", ex=ttl)
                pipe.delete(*(relay.reply for relay in relays))
                await pipe.execute()
        except Exception:  # Redis away: the streams' TTL removes them
            pass

    def _located(self, k: int, exc: Exception) -> Exception:
        if not isinstance(exc, InvalidInput) or not self.prompt_locs:
            return exc
        for error in exc.errors:
            if list(error.get("loc") or []) == ["body", "prompt"]:
                error["loc"] = self.prompt_locs[k]
        return exc

    async def collect(self) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """Each request's ``(start, end)`` events, in the requests' order."""
        starts: dict[int, dict[str, Any]] = {}
        ends: dict[int, dict[str, Any]] = {}
        async for k, event in self.events():
            if event["type"] == "start":
                starts[k] = event
            elif event["type"] == "end":
                ends[k] = event
        return [(starts.get(k, {}), ends[k]) for k in range(len(self.requests))]
