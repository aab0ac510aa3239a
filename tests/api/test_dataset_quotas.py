"""Datasets under concurrency: the owner's room holds against parallel uploads, preparation
is shared fairly between owners, the children never outnumber their limit, and an upload has
a total deadline.

The concurrent ones run the real app under uvicorn (real HTTP, chunked bodies that stay open),
with PostgreSQL, Redis and the preparation children as in a deployment.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from fastapi import FastAPI

from service.api.app import create_app
from service.api.core.settings import Settings
from service.api.datasets.quota import folder_bytes, prepared_bound
from service.api.datasets.slots import FairSlots
from tests.api.support import Api, Uvicorn, make_tokens
from tests.api.test_datasets import nothing_left, ready, upload, wait_done

SETTING = "TRAINQ_DATASET_MAX_OWNER_BYTES"


@dataclass
class Served:
    app: FastAPI
    url: str
    settings: Settings
    token: str
    other: str

    def post(self, body: Any, name: str, token: str | None = None, **params: Any) -> httpx.Response:
        return httpx.post(
            f"{self.url}/v1/datasets",
            params={"name": name, **params},
            content=body,
            headers={"Authorization": f"Bearer {token or self.token}"},
            timeout=120,
        )

    def get(self, name: str, token: str | None = None) -> dict[str, Any]:
        resp = httpx.get(
            f"{self.url}/v1/datasets/{name}",
            headers={"Authorization": f"Bearer {token or self.token}"},
        )
        assert resp.status_code == 200, resp.text
        found: dict[str, Any] = resp.json()
        return found

    def listed(self, token: str | None = None) -> list[dict[str, Any]]:
        resp = httpx.get(
            f"{self.url}/v1/datasets", headers={"Authorization": f"Bearer {token or self.token}"}
        )
        items: list[dict[str, Any]] = resp.json()["items"]
        return items

    def done(self, name: str, token: str | None = None, timeout: float = 120) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            found = self.get(name, token)
            if found["status"] not in ("uploading", "preparing"):
                return found
            assert time.monotonic() < deadline, found
            time.sleep(0.05)


@pytest.fixture()
def serve(make_settings: Callable[..., Settings]) -> Iterator[Callable[..., Any]]:
    """``serve(**settings)``: the app under uvicorn, with two owners' tokens."""

    @contextmanager
    def build(**overrides: Any) -> Iterator[Served]:
        settings = make_settings(**overrides)
        app = create_app(settings)
        _, token, other, _ = make_tokens(app.state.services)
        with Uvicorn(app) as server:
            yield Served(app, server.url, settings, token, other)

    yield build


def prepare_children() -> list[int]:
    """This process's preparation children (the app runs in it), read from /proc."""
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == me and b"service.api.datasets.prepare" in cmd:
            found.append(int(entry))
    return found


class Sampler:
    """The most preparation children seen at once, sampled every few ms in a thread."""

    def __init__(self) -> None:
        self.most = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.most = max(self.most, len(prepare_children()))
            time.sleep(0.003)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join(5)


def _work_files(settings: Settings) -> list[str]:
    work = Path(settings.data_root) / "datasets" / ".tmp"
    return sorted(p.name for p in work.iterdir()) if work.exists() else []


def test_parallel_uploads_never_pass_the_owners_room(serve: Callable[..., Any]) -> None:
    """Ten uploads at once (half with a Content-Length, half chunked) against room for two:
    what is accepted fits, on disk too; the rest are 413 naming the setting, leaving no row
    and no file."""
    size = 200_000
    bound = prepared_bound("text", size)
    room = 2 * bound + bound // 2
    with serve(dataset_max_owner_bytes=room) as s:
        start = threading.Barrier(10)
        answers: dict[str, httpx.Response] = {}

        def one(i: int) -> None:
            body = bytes([97 + i]) * size
            pieces = (body[k : k + 50_000] for k in range(0, size, 50_000))
            start.wait()
            answers[f"c{i}"] = s.post(body if i % 2 else pieces, f"c{i}")

        threads = [threading.Thread(target=one, args=(i,)) for i in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        accepted = sorted(n for n, r in answers.items() if r.status_code == 202)
        refused = {n: r for n, r in answers.items() if r.status_code != 202}
        assert len(answers) == 10 and 1 <= len(accepted) <= 2, answers
        for name, resp in refused.items():
            assert resp.status_code == 413, (name, resp.text)
            assert SETTING in resp.json()["detail"] and str(room) in resp.json()["detail"]
        found = [s.done(n) for n in accepted]
        assert all(f["status"] == "ready" for f in found), found
        assert sorted(d["name"] for d in s.listed()) == accepted  # no row of a refused one
        on_disk = sum(folder_bytes(Path(s.settings.data_root) / f["path"]) for f in found)
        assert on_disk == sum(f["disk_bytes"] for f in found) <= room
        assert on_disk >= 2 * size * len(accepted)  # 2 bytes a token: the shards, counted
        assert _work_files(s.settings) == []


def test_a_failed_or_deleted_dataset_releases_its_room(api: Api) -> None:
    size = 100_000
    api.settings.dataset_max_owner_bytes = prepared_bound("text", size) + 1000  # room for one
    bad = upload(api, b"a" * (size - 1) + b"\xff", name="bad")  # refused at its last byte
    assert bad.status_code == 422
    nothing_left(api, "bad")
    # A preparation that fails (too few tokens for the val split) holds nothing either.
    failed = upload(api, b"a", name="tiny", val_fraction=0.9)
    assert failed.status_code == 202

    gone = wait_done(api, "tiny")
    assert gone["status"] == "failed" and gone["disk_bytes"] == 0
    one = ready(api, b"a" * size, name="one")
    folder = Path(api.settings.data_root) / one["path"]
    assert one["disk_bytes"] == folder_bytes(folder) >= 2 * size  # its shards, not the upload
    over = upload(api, b"b" * size, name="two")
    assert over.status_code == 413 and SETTING in over.json()["detail"]
    nothing_left(api, "two")
    assert api.client.delete("/v1/datasets/one", headers=api.headers()).status_code == 204
    assert ready(api, iter([b"b" * size]), name="two")["status"] == "ready"  # chunked


def _at(found: dict[str, Any]) -> datetime:
    return datetime.fromisoformat(found["ready_at"])


def test_preparation_is_shared_fairly_between_owners(serve: Callable[..., Any]) -> None:
    """One slot. Owner A's open upload holds it (its warm child); A's three more uploads and
    then owner B's one wait for it. When it frees, B's goes first, before A's waiting ones."""
    with serve(dataset_prepare_workers=1) as s, Sampler() as seen:
        release = threading.Event()
        answers: list[httpx.Response] = []

        def held() -> Iterator[bytes]:
            yield b"x" * 1000
            release.wait(60)
            yield b"y" * 1000

        first = threading.Thread(target=lambda: answers.append(s.post(held(), "a0")))
        first.start()
        deadline = time.monotonic() + 30
        while len(prepare_children()) != 1:  # a0's warm child holds the slot
            assert time.monotonic() < deadline
            time.sleep(0.01)
        for name in ("a1", "a2", "a3"):
            assert s.post(b"a" * 20_000, name).status_code == 202
        assert s.post(b"b" * 2_000, "b", token=s.other).status_code == 202
        release.set()
        first.join(60)
        assert answers[0].status_code == 202, answers[0].text
        found = {n: s.done(n) for n in ("a0", "a1", "a2", "a3")}
        found["b"] = s.done("b", s.other)
    assert all(f["status"] == "ready" for f in found.values()), found
    order = sorted(found, key=lambda n: _at(found[n]))
    assert order[:2] == ["a0", "b"], order  # first come first served would be a0..a3, b
    assert seen.most == 1


def test_a_burst_of_uploads_never_starts_more_children_than_the_limit(
    serve: Callable[..., Any],
) -> None:
    with serve(dataset_prepare_workers=2) as s, Sampler() as seen:
        start = threading.Barrier(8)
        answers: dict[str, httpx.Response] = {}

        def one(i: int) -> None:
            def body() -> Iterator[bytes]:
                for _ in range(5):
                    yield b"z" * 20_000
                    time.sleep(0.05)

            start.wait()
            answers[f"u{i}"] = s.post(body(), f"u{i}", token=s.other if i % 2 else None)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert sorted(r.status_code for r in answers.values()) == [202] * 8, answers
        for name in answers:
            token = s.other if int(name[1:]) % 2 else None
            assert s.done(name, token)["status"] == "ready"
    assert 1 <= seen.most <= 2, seen.most


def test_an_upload_past_its_total_deadline_is_408_and_leaves_nothing(
    serve: Callable[..., Any],
) -> None:
    """A chunk every 0.1 s is never idle, but the upload as a whole has 1 s."""
    with serve(dataset_upload_idle_s=5, dataset_upload_max_s=1.0) as s:
        url = urlsplit(s.url)
        started = time.monotonic()
        answer = b""
        with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
            head = (
                "POST /v1/datasets?name=trickle HTTP/1.1\r\n"
                f"Host: {url.hostname}\r\nAuthorization: Bearer {s.token}\r\n"
                "Transfer-Encoding: chunked\r\nContent-Type: application/octet-stream\r\n\r\n"
            )
            sock.sendall(head.encode())
            sock.settimeout(0.1)
            while b"UPLOAD" not in answer:
                assert time.monotonic() - started < 20, answer
                try:
                    sock.sendall(b"5\r\nhello\r\n")
                except OSError:
                    pass  # the server answered and closed
                try:
                    got = sock.recv(4096)
                except TimeoutError:
                    continue
                assert got, answer
                answer += got
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert b"TRAINQ_DATASET_UPLOAD_MAX_S" in answer, answer
        assert time.monotonic() - started >= 1.0
        assert s.listed() == []
        assert _work_files(s.settings) == [] and prepare_children() == []


def test_fair_slots_serve_owners_in_turn_and_a_cancelled_waiter_takes_nothing() -> None:
    async def main() -> tuple[list[str], int]:
        slots = FairSlots(1)
        assert slots.try_take("a", share=1) and not slots.try_take("b", share=1)
        order: list[str] = []

        async def wait(owner: str, tag: str) -> None:
            await slots.take(owner)
            order.append(tag)
            await asyncio.sleep(0)
            slots.give(owner)

        tags = [("a", "a1"), ("a", "a2"), ("c", "c1"), ("b", "b1"), ("d", "d1")]
        tasks = {tag: asyncio.create_task(wait(o, tag)) for o, tag in tags}
        await asyncio.sleep(0)  # all five wait
        tasks["d1"].cancel()
        slots.give("a")
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        return order, slots.held.total()

    order, held = asyncio.run(main())
    # a held the slot: the owners never served go first (in the order they came), then a's
    assert order == ["c1", "b1", "a1", "a2"] and held == 0
