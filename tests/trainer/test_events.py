"""trainer.events: the records round-trip through a real Redis, and the Publisher keeps
events in order through a Redis outage (a private redis-server we stop and start)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from trainer.events import Event, Keys, Publisher


def test_event_round_trips_through_fields() -> None:
    ev = Event("metric", "j1", 2, "trainer", 7, {"step": 3, "loss": 1.5, "mfu": None})
    back = Event.from_fields({k.encode(): v.encode() for k, v in ev.to_fields().items()})
    assert back == ev
    assert back.key == ("j1", 2, "trainer", 7)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"kind": "metric"}, "missing field"),
        (
            {
                "kind": "bogus",
                "job": "j",
                "attempt": "1",
                "src": "w",
                "seq": "1",
                "ts": "1",
                "data": "{}",
            },
            "unknown event kind",
        ),
        (
            {
                "kind": "log",
                "job": "j",
                "attempt": "1",
                "src": "w",
                "seq": "1",
                "ts": "1",
                "data": "[1]",
            },
            "must be an object",
        ),
    ],
)
def test_malformed_fields_are_a_value_error(fields: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Event.from_fields(fields)


def test_nan_is_refused_at_encoding() -> None:
    with pytest.raises(ValueError):
        Event("metric", "j", 1, "trainer", 1, {"loss": float("nan")}).to_fields()


def _read_all(client: redis.Redis, key: str) -> list[Event]:
    return [Event.from_fields(f) for _, f in client.xrange(key)]


def test_publisher_writes_both_streams_in_order(redis_url: str, redis_client: redis.Redis) -> None:
    keys = Keys("tq-events-test")
    pub = Publisher(redis_url, "job-a", 1, "worker", prefix=keys.prefix)
    for i in range(50):
        pub.emit("log", {"lines": [{"rank": 0, "stream": "stdout", "line": f"line {i}"}]})
    assert pub.close(timeout=10)
    for key in (keys.events, keys.job("job-a")):
        events = _read_all(redis_client, key)
        assert [e.seq for e in events] == list(range(1, 51))
        assert events[-1].data["lines"][0]["line"] == "line 49"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrivateRedis:
    """A redis-server of this test's own, so stopping it disturbs nobody else."""

    def __init__(self, tmp: Path) -> None:
        self.port = _free_port()
        self.tmp = tmp
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        exe = shutil.which("redis-server")
        assert exe, "redis-server is not installed"
        self.proc = subprocess.Popen(
            [
                exe,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.tmp),
            ],
            stdout=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port)
        for _ in range(100):
            try:
                client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("private redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None


@pytest.fixture()
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    server = PrivateRedis(tmp_path)
    server.start()
    yield server
    server.stop()


def test_publisher_survives_an_outage_without_loss_or_reorder(private_redis: PrivateRedis) -> None:
    url = f"redis://127.0.0.1:{private_redis.port}/0"
    keys = Keys("trainq")
    pub = Publisher(url, "job-b", 1, "trainer", retry_s=0.05)
    for i in range(10):
        pub.emit("metric", {"step": i})
    assert pub.flush(timeout=10)
    # The server keeps nothing on disk, so what was sent before the outage is gone with it;
    # what matters is that nothing emitted during the outage is lost or reordered.
    private_redis.stop()
    t0 = time.monotonic()
    for i in range(10, 30):
        pub.emit("metric", {"step": i})
    assert time.monotonic() - t0 < 0.5, "emit must never block on a dead Redis"
    time.sleep(0.3)
    assert pub.pending() == 20
    private_redis.start()
    assert pub.flush(timeout=15)
    assert pub.close(timeout=5)
    steps = [e.data["step"] for e in _read_all(redis.Redis(port=private_redis.port), keys.events)]
    assert steps == list(range(10, 30))


def test_publisher_keeps_a_refused_batch_and_sends_it_once_redis_accepts(
    private_redis: PrivateRedis,
) -> None:
    """A batch that Redis refuses (out of memory: every XADD is refused while queued, so EXEC
    aborts) is kept and retried, and the connection is not left with unread replies that a
    later batch would take for its own."""
    client = redis.Redis(port=private_redis.port)
    keys = Keys("trainq")
    pub = Publisher(f"redis://127.0.0.1:{private_redis.port}/0", "job-r", 1, "trainer",
                    retry_s=0.05)  # fmt: skip
    pub.emit("metric", {"step": 0})
    assert pub.flush(timeout=10)
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", 1)
    for i in range(1, 5):
        pub.emit("metric", {"step": i})
    assert not pub.flush(timeout=0.5)
    assert pub.link_down and pub.pending() == 4
    client.config_set("maxmemory", 0)
    for i in range(5, 8):
        pub.emit("metric", {"step": i})
    assert pub.close(timeout=10)
    assert not pub.link_down
    for key in (keys.events, keys.job("job-r")):
        assert [e.data["step"] for e in _read_all(client, key)] == list(range(8))


def test_close_gives_up_within_its_timeout_when_redis_is_gone() -> None:
    pub = Publisher(f"redis://127.0.0.1:{_free_port()}/0", "job-c", 1, "trainer", retry_s=0.05)
    pub.emit("metric", {"step": 1})
    t0 = time.monotonic()
    assert pub.close(timeout=1.0) is False
    assert time.monotonic() - t0 < 4


def test_events_module_imports_neither_torch_nor_redis() -> None:
    code = (
        "import sys, trainer.events, trainer.config, worker.message;"
        "print('torch' in sys.modules, 'redis' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    ).stdout.split()
    assert out == ["False", "False"]
