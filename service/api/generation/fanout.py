"""One OpenAI call as several worker requests (a completions call with a list of prompts:
one ``GenerateRequest`` per prompt), sent concurrently so the worker can batch them, at most
``slots`` at a time (``TRAINQ_GENERATE_FANOUT``; the call holds one in-flight slot,
``service.api.generation.inflight``).

``Fanout.events()`` merges the requests' reply events as they come, each tagged with its
request's position; the first error of any request cancels the others and is raised (its
HTTP answer). Every relay is closed however the call ends (the worker is told to stop what
the client no longer waits for).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

from service.api.core.deps import Services
from service.api.core.errors import InvalidInput
from service.api.generation.service import Relay, Target
from worker.genmessage import GenerateRequest

__all__ = ["Fanout"]

_DONE = object()


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
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        gate = asyncio.Semaphore(self.slots)

        async def pump(k: int, request: GenerateRequest) -> None:
            async with gate:
                relay = Relay(self.services, self.target, request)
                try:
                    await relay.send()
                    async for event in relay.events():
                        await queue.put((k, event))
                except Exception as exc:  # the call's answer: raised by the reader
                    await queue.put((k, self._located(k, exc)))
                finally:
                    await relay.close()
                    await queue.put((k, _DONE))

        tasks = [asyncio.create_task(pump(k, r)) for k, r in enumerate(self.requests)]
        running = len(tasks)
        try:
            while running:
                k, item = await queue.get()
                if item is _DONE:
                    running -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield k, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

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
