"""Fixtures for the dashboard's browser tests: a whole running system and headless Chromium.

See ``tests/e2e/system.py`` for what runs: the API under uvicorn, PostgreSQL, Redis and a
Celery worker that launches the trainer with torchrun on CPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.system import CHROMIUM, CHROMIUM_ARGS, System


@pytest.fixture(scope="module")
def dash_system(
    pg_url: str,
    redis_dbs: Any,
    subprocess_env: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[System]:
    """Stores, settings and a migrated database; the test module starts the processes."""
    from service.migrate import upgrade
    from trainer.prepare import prepare_demo

    root = tmp_path_factory.mktemp("dash")
    data_root = root / "data"
    prepare_demo(data_root / "demo")
    redis_url = redis_dbs.url(redis_dbs.claim())
    prefix = "trainq"
    env = {
        **subprocess_env,
        "TRAINQ_DATABASE_URL": pg_url,
        "TRAINQ_REDIS_URL": redis_url,
        "TRAINQ_BROKER_URL": redis_dbs.url(redis_dbs.claim()),
        "TRAINQ_REDIS_PREFIX": prefix,
        "TRAINQ_DATA_ROOT": str(data_root),
        "TRAINQ_RUNS_ROOT": str(root / "runs"),
        # A cancelled trainer saves a checkpoint on SIGTERM; it does not need 30 s for that.
        "TRAINQ_CANCEL_GRACE_S": "10",
    }
    log_dir = root / "logs"
    log_dir.mkdir()
    upgrade(pg_url)  # what `trainq db upgrade` runs; a no-op if another module already did
    system = System(env, redis_url, prefix, log_dir)
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
