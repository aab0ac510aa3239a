"""How fast the dashboard draws a long run's charts: API-downsampled history against all of it.

    .venv/bin/python bench/dashboard_render.py [--rows 100000] [--rounds 5] [--points 2000]

Stands up the real system once (PostgreSQL, Redis, the API under uvicorn with its ingestor),
submits a job to a queue no worker serves and streams ``--rows`` metric events into Redis as
a trainer's rank 0 would; the ingestor stores them. Then headless Chromium opens the job's
page, alternating (A B, B A, ...) between:

- ``downsampled``: the page as shipped, which asks ``/metrics?max_points=2000``
- ``full``:        the same page asking for every point (``#/jobs/ID?points=100000``)

and reports, per variant, the median time from the view's mount to its charts drawn (the
history request included), the draw alone, and the points drawn; then the ratio. The goal
is the downsampled page under a second with 100,000 rows stored.

Needs a PostgreSQL (``TRAINQ_TEST_PG_URL``, as the tests) and a Redis on 127.0.0.1:6379
(a free database number is claimed as the tests do), and Debian's chromium.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import sqlalchemy as sa  # noqa: E402

from tests.conftest import PG_ADMIN_URL, RedisDBs  # noqa: E402
from tests.e2e.system import CHROMIUM, CHROMIUM_ARGS, System  # noqa: E402


def subprocess_env() -> dict[str, str]:
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO)
    env["OMP_NUM_THREADS"] = "1"
    return env


def fill(system: System, api_url: str, rows: int) -> str:
    from trainer.events import Publisher

    with httpx.Client(base_url=api_url, timeout=30) as client:
        r = client.post(
            "/v1/jobs", json={"name": "bench-long", "queue": "bench-nowhere", "train": {}}
        )
        r.raise_for_status()
        job_id = str(r.json()["id"])
        t0 = time.perf_counter()
        pub = Publisher(system.redis_url, job_id, 1, "trainer", prefix=system.prefix)
        for step in range(1, rows + 1):
            pub.emit(
                "metric",
                {
                    "step": step,
                    "steps": rows,
                    "loss": 5.0 / (1 + step / 2000),
                    "val_loss": 5.2 / (1 + step / 2000) if step % 100 == 0 else None,
                    "lr": 3e-4 * min(1.0, step / 1000),
                    "tokens_per_s": 1e5 + (step % 977),
                },
            )
        assert pub.close(timeout=120), "could not publish every event"
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            total = client.get(f"/v1/jobs/{job_id}/metrics", params={"max_points": 1}).json()
            if total["total"] == rows:
                break
            time.sleep(0.5)
        else:
            raise SystemExit("the ingestor did not store every row in time")
        print(f"ingested {rows} metric events in {time.perf_counter() - t0:.1f}s")
    return job_id


def measure(browser: Any, api_url: str, job_id: str, points: int | None) -> dict[str, float]:
    context = browser.new_context(base_url=api_url, viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(120_000)
    suffix = f"?points={points}" if points else ""
    page.goto(f"/#/jobs/{job_id}{suffix}")
    page.wait_for_function(
        "() => window.__trainq.job && window.__trainq.job.firstRenderMs !== null"
    )
    out = page.evaluate(
        "() => ({first: __trainq.job.firstRenderMs, fetch: __trainq.job.historyFetchMs,"
        " draw: __trainq.job.drawMs, drawn: __trainq.job.chartPoints().loss})"
    )
    context.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    if not CHROMIUM.exists():
        raise SystemExit(f"{CHROMIUM} not found: apt-get install -y chromium")

    from playwright.sync_api import sync_playwright

    from service.api.core.migrate import upgrade

    name = f"trainq_bench_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    pg_url = PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    dbs = RedisDBs()
    tmp = Path(tempfile.mkdtemp(prefix="trainq-bench-"))
    system: System | None = None
    try:
        upgrade(pg_url)
        redis_url = dbs.url(dbs.claim())
        env = {
            **subprocess_env(),
            "TRAINQ_DATABASE_URL": pg_url,
            "TRAINQ_REDIS_URL": redis_url,
            "TRAINQ_BROKER_URL": dbs.url(dbs.claim()),
            "TRAINQ_DATA_ROOT": str(tmp),
            "TRAINQ_RUNS_ROOT": str(tmp / "runs"),
        }
        system = System(env, redis_url, "trainq", tmp)
        api = system.start_api(auth=False)
        job_id = fill(system, api.url, args.rows)
        results: dict[str, list[dict[str, float]]] = {"downsampled": [], "full": []}
        variants = {"downsampled": None, "full": 100_000}
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
            measure(browser, api.url, job_id, None)  # warm-up: caches, JIT
            for r in range(args.rounds):
                order = list(variants) if r % 2 == 0 else list(reversed(variants))
                for v in order:
                    results[v].append(measure(browser, api.url, job_id, variants[v]))
            browser.close()
    finally:
        if system is not None:
            system.stop()
        dbs.release()
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()

    med: dict[str, dict[str, float]] = {}
    print(f"\n{args.rows} metric rows stored; median of {args.rounds} page loads each")
    print(
        f"{'variant':<12} {'mount->drawn ms':>16} {'of which fetch ms':>18} {'draw ms':>9}"
        f" {'points drawn':>13}"
    )
    for v, runs in results.items():
        keys = ("first", "fetch", "draw", "drawn")
        med[v] = {k: statistics.median(x[k] for x in runs) for k in keys}
        m = med[v]
        print(
            f"{v:<12} {m['first']:>16.1f} {m['fetch']:>18.1f} {m['draw']:>9.1f} {m['drawn']:>13.0f}"
        )
    ratio = med["full"]["first"] / med["downsampled"]["first"]
    draw_ratio = med["full"]["draw"] / max(med["downsampled"]["draw"], 1e-3)
    print(f"\nfull / downsampled: time to drawn {ratio:.1f}x, draw alone {draw_ratio:.1f}x")
    ok = med["downsampled"]["first"] < 1000
    print(f"goal (downsampled under 1000 ms): {'met' if ok else 'NOT met'}")


if __name__ == "__main__":
    main()
