"""Fixtures of the end-to-end tests: whole running systems, and headless Chromium.

See ``tests/e2e/system.py`` for what runs: the API under uvicorn, PostgreSQL, Redis and
Celery workers that launch the trainer with torchrun on CPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.system import CHROMIUM, CHROMIUM_ARGS, System, build_system

# The system tests wait for heartbeats to expire and for cancels and deadlines to take
# effect, so every interval is short: a lost worker is noticed within ~4 s, not ~20 s.
FAST_SETTINGS = {
    "TRAINQ_HEARTBEAT_TTL_S": "3",  # worker: heartbeat key TTL, refreshed every 1 s
    "TRAINQ_HEARTBEAT_GRACE_S": "1",  # API: a heartbeat missing this long is lost
    "TRAINQ_RECONCILE_INTERVAL_S": "0.5",
    "TRAINQ_CANCEL_GRACE_S": "5",  # the trainer checkpoints on SIGTERM within a second
    "TRAINQ_CANCEL_POLL_S": "0.5",
    "TRAINQ_REGISTRY_INTERVAL_S": "1",
    "TRAINQ_LOG_BATCH_S": "0.1",
    "TRAINQ_SSE_PING_S": "2",  # a stream that missed its terminal event ends soon
    "TRAINQ_INGEST_BLOCK_MS": "200",
}


@pytest.fixture(scope="module")
def dash_system(
    pg_url: str,
    redis_dbs: Any,
    subprocess_env: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[System]:
    """Stores, settings and a migrated database; the test module starts the processes."""
    root = tmp_path_factory.mktemp("dash")
    # A cancelled trainer saves a checkpoint on SIGTERM; it does not need 30 s for that.
    system = build_system(root, pg_url, redis_dbs, subprocess_env, {"TRAINQ_CANCEL_GRACE_S": "10"})
    yield system
    system.stop()


@pytest.fixture(scope="module")
def fast_system(
    pg_url: str,
    redis_dbs: Any,
    subprocess_env: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[System]:
    """Like ``dash_system``, with short heartbeat, reconcile, cancel and log intervals."""
    root = tmp_path_factory.mktemp("system")
    system = build_system(root, pg_url, redis_dbs, subprocess_env, dict(FAST_SETTINGS))
    yield system
    system.stop()


@pytest.fixture(scope="module")
def dash_browser() -> Iterator[Any]:
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} not found: apt-get install -y chromium (Debian's build)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()
