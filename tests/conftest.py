"""Shared fixtures: a real Redis database and a real PostgreSQL database per test session.

Several test sessions may run at once on one machine (developers side by side, CI), so each
session claims its own Redis database number (SET NX on db 0) and creates its own
PostgreSQL database, and removes both at the end.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import early

REPO = Path(__file__).resolve().parent.parent
REDIS_HOST = os.environ.get("TRAINQ_TEST_REDIS_HOST", "127.0.0.1")
REDIS_PORT = int(os.environ.get("TRAINQ_TEST_REDIS_PORT", "6379"))
PG_ADMIN_URL = os.environ.get(
    "TRAINQ_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
# How long a session waits for a Redis database number while other sessions hold all 14;
# under pytest-timeout's 300 s a test, so the error that names the holders comes first.
CLAIM_WAIT_S = 240.0


def pytest_configure(config: pytest.Config) -> None:
    early.configure(config)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:  # pytest-xdist's controller, for each worker
    early.configure_node(node)


def pytest_collection_finish(session: pytest.Session) -> None:
    early.start_all(session.config, [item.nodeid for item in session.items])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    early.start_all(node.config, ids)  # the controller: a worker's collection


def pytest_unconfigure(config: pytest.Config) -> None:
    early.stop_all(config)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def subprocess_env() -> dict[str, str]:
    """Environment for child processes (torchrun, celery, the API): our packages importable."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])]
    )
    env["PYTHONUNBUFFERED"] = "1"
    # Each rank on a 2-core machine gets one thread, so two ranks do not fight over cores.
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


class RedisDBs:
    """Hands out whole Redis database numbers (2..15) claimed for this test session.

    0 and 1 are the defaults of TRAINQ_REDIS_URL and TRAINQ_BROKER_URL, so a process started
    with default settings never lands in a test's database.
    """

    def __init__(self) -> None:
        import redis

        self._admin = redis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=0)
        self._token = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.claimed: list[int] = []

    def claim(self) -> int:
        """A free database number, waiting (up to CLAIM_WAIT_S) while other sessions hold all
        of them: sessions side by side on a busy machine take turns instead of failing."""
        deadline = time.monotonic() + CLAIM_WAIT_S
        while (n := self._try_claim()) is None:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"no free Redis database number (2..15) for this test session after "
                    f"{CLAIM_WAIT_S:g} s; held by sessions {self._holders()}"
                )
            time.sleep(0.5)
        self.claimed.append(n)
        import redis

        redis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=n).flushdb()
        return n

    def _try_claim(self) -> int | None:
        for n in range(2, 16):
            key = f"trainq-test:db:{n}"
            self._release_if_dead(key)
            if self._admin.set(key, self._token, nx=True, ex=4 * 3600):
                return n
        return None

    def _holders(self) -> list[str]:
        keys = [f"trainq-test:db:{n}" for n in range(2, 16)]
        return sorted({v.decode() for v in self._admin.mget(keys) if v is not None})

    def _release_if_dead(self, key: str) -> None:
        """A claim whose test session died (killed, timed out) is freed at once, not in 4 h."""
        owner = self._admin.get(key)
        if owner is None:
            return
        pid = owner.decode().split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            # Delete only if it still holds that dead owner's token.
            self._admin.eval(
                "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) "
                "end return 0",
                1,
                key,
                owner,
            )

    def url(self, n: int) -> str:
        return f"redis://{REDIS_HOST}:{REDIS_PORT}/{n}"

    def give_back(self, n: int) -> None:
        """Database ``n`` emptied and free for the next claim (a module's system is done)."""
        import redis

        redis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=n).flushdb()
        key = f"trainq-test:db:{n}"
        if self._admin.get(key) == self._token.encode():
            self._admin.delete(key)
        if n in self.claimed:
            self.claimed.remove(n)

    def release(self) -> None:
        for n in list(self.claimed):
            self.give_back(n)


@pytest.fixture(scope="session")
def redis_dbs() -> Iterator[RedisDBs]:
    dbs = RedisDBs()
    try:
        dbs._admin.ping()
    except Exception as exc:
        pytest.fail(f"Redis is not reachable at {REDIS_HOST}:{REDIS_PORT}: {exc}")
    yield dbs
    dbs.release()


@pytest.fixture(scope="session")
def redis_url(redis_dbs: RedisDBs) -> str:
    """A Redis database of this session's own (events, heartbeats, workers)."""
    return redis_dbs.url(redis_dbs.claim())


@pytest.fixture()
def redis_client(redis_url: str) -> Iterator[object]:
    import redis

    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield client
    client.close()


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A fresh PostgreSQL database for this session, dropped at the end."""
    import sqlalchemy as sa

    name = f"trainq_test_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:
        pytest.fail(f"PostgreSQL is not reachable at {PG_ADMIN_URL}: {exc}")
    url = PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    yield url
    with admin.connect() as conn:
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()
