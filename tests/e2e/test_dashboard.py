"""The dashboard in headless Chromium against a running system (see conftest.py).

A job submitted over the API shows in the table; its page draws points while the trainer
runs, resumes the event stream after a dropped connection without drawing a point twice,
follows the logs and cancels the job. A long run's history is downsampled by the API, so the
chart stays bounded. With auth on, a token is entered once and kept.
"""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.system import CHROMIUM, Api, System, wait_for

pytestmark = [
    pytest.mark.skipif(
        not CHROMIUM.exists(), reason=f"{CHROMIUM} not found: apt-get install -y chromium"
    ),
    pytest.mark.timeout(240),
]

NOTES = Path(__file__).resolve().parents[2] / ".notes"
# A tiny model that keeps reporting until it is cancelled (steps far beyond the test).
TRAIN: dict[str, Any] = {
    "steps": 100_000,
    "model": {"n_layer": 1, "n_head": 2, "d_model": 32, "seq_len": 32, "vocab_size": 256},
    "data": {"path": "demo"},
    "batch": {"micro_batch_size": 4},
    "optim": {"warmup_steps": 20},
    "eval": {"every": 25, "steps": 1},
    "checkpoint": {"every": 0},
    "log_every": 1,
}
NO_WORKER_QUEUE = "dash-nowhere"  # jobs here stay queued: no worker serves it
HISTORY_POINTS = 2000  # what the page asks the API for (job.js HISTORY_POINTS)


@pytest.fixture(scope="module")
def api(dash_system: System) -> Api:
    return dash_system.start_api(auth=False)


@pytest.fixture(scope="module")
def worker(dash_system: System, api: Api) -> object:
    return dash_system.start_worker("cpu")


@pytest.fixture()
def browser_page(dash_browser: Any, api: Api) -> Any:
    context = dash_browser.new_context(base_url=api.url, viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(60_000)
    page.requests = []  # every URL the page asked for: all must be this server's
    page.errors = []
    page.on("request", lambda r: page.requests.append(r.url))
    page.on("pageerror", lambda e: page.errors.append(str(e)))
    page.on("console", lambda m: page.errors.append(m.text) if m.type == "error" else None)
    yield page
    context.close()


def submit(api: Api, name: str, queue: str = "cpu") -> str:
    with api.client() as client:
        r = client.post("/v1/jobs", json={"name": name, "queue": queue, "train": TRAIN})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def job_status(api: Api, job_id: str) -> str:
    with api.client() as client:
        return str(client.get(f"/v1/jobs/{job_id}").json()["status"])


def js(page: Any, expr: str) -> Any:
    return page.evaluate(f"() => {expr}")


def test_page_and_assets_are_served_from_the_api(api: Api) -> None:
    with httpx.Client(base_url=api.url) as client:
        page = client.get("/")
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/html")
        assert "default-src 'self'" in page.headers["content-security-policy"]
        # Nothing is loaded from another origin: the page works offline.
        assert "http://" not in page.text and "https://" not in page.text
        lib = client.get("/ui/vendor/uplot/uPlot.iife.min.js")
        assert lib.status_code == 200 and "uPlot" in lib.text
        assert lib.headers["content-type"].startswith("text/javascript")
        again = client.get(
            "/ui/vendor/uplot/uPlot.iife.min.js", headers={"If-None-Match": lib.headers["etag"]}
        )
        assert again.status_code == 304
        assert client.get("/ui/js/nope.js").status_code == 404
        assert client.get("/ui/../pyproject.toml").status_code == 404
        assert client.get("/ui/%2e%2e/app.py").status_code == 404
        # The page is not an API route: it stays out of the OpenAPI document.
        assert "/ui/{path}" not in client.get("/openapi.json").json()["paths"]


SSE_PARSE = """async (chunks) => {
  const { parseSSE } = await import("/ui/js/sse.js");
  const bytes = new TextEncoder().encode(chunks.join(""));
  // Cut the bytes at the given offsets: inside a CRLF, inside a UTF-8 character, anywhere.
  const cuts = [0, 7, 8, 30, 41, 42, 60, 77, bytes.length];
  const body = new ReadableStream({
    start(c) {
      for (let i = 1; i < cuts.length; i++) c.enqueue(bytes.slice(cuts[i - 1], cuts[i]));
      c.close();
    },
  });
  const out = [];
  for await (const ev of parseSSE(body)) out.push(ev);
  return out;
}"""


def test_sse_parser_handles_split_chunks(browser_page: Any) -> None:
    page = browser_page
    page.goto("/")
    stream = [
        'id: 1-0\r\nevent: metric\r\ndata: {"a":1}\r\n\r\n',
        ": ping\n\n",
        "data: x\ndata: \u00e9t\u00e9\n\n",
        "retry: 2000\n\n",
        "id: 2-0\nevent: log\ndata:z\n\n",
        "data: cut off before its blank line",
    ]
    events = page.evaluate(SSE_PARSE, stream)
    assert events == [
        {"type": "metric", "data": '{"a":1}', "id": "1-0"},
        {"type": "message", "data": "x\n\u00e9t\u00e9", "id": None},
        {"type": "__retry", "data": "2000", "id": None},
        {"type": "log", "data": "z", "id": "2-0"},
    ]


def test_live_job_table_chart_logs_and_cancel(
    dash_browser: Any, api: Api, worker: object, browser_page: Any, tmp_path: Path
) -> None:
    page = browser_page
    job_id = submit(api, "dash-live")
    page.goto("/")
    row = page.locator(f'tr[data-job-id="{job_id}"]')
    row.wait_for()
    assert "dash-live" in row.inner_text()
    # The table updates itself: the same row turns running once the worker launched it.
    row.locator('[data-status="running"]').wait_for(timeout=90_000)

    row.click()
    page.wait_for_function("() => window.__trainq.job && window.__trainq.job.points() > 0")
    before = js(page, "window.__trainq.job.chartPoints().loss")
    page.wait_for_function(f"() => window.__trainq.job.chartPoints().loss >= {before + 10}")
    counts = js(page, "window.__trainq.job.chartPoints()")
    assert counts["loss"] == counts["throughput"] == counts["lr"] > before

    # Drop the stream: the page reconnects with Last-Event-ID and draws nothing twice.
    events_before = js(page, "window.__trainq.job.metricEvents")
    js(page, "window.__trainq.job.stream.drop()")
    page.wait_for_function("() => window.__trainq.job.stream.connects >= 2")
    page.wait_for_function(f"() => window.__trainq.job.metricEvents > {events_before + 10}")
    state = js(
        page,
        "({dup: __trainq.job.duplicateEvents, live: __trainq.job.liveSteps,"
        " steps: __trainq.job.steps()})",
    )
    assert state["dup"] == 0
    live = state["live"]
    assert live == list(range(live[0], live[0] + len(live))), "the stream skipped or repeated"
    assert state["steps"] == sorted(set(state["steps"])), "a step is drawn twice"

    # Attempts with host; logs that follow.
    attempt = page.locator('tr[data-attempt="1"]')
    attempt.wait_for()
    page.wait_for_function(
        "h => document.querySelector('tr[data-attempt=\"1\"]').innerText.includes(h)",
        arg=socket.gethostname(),
    )
    page.wait_for_function("() => document.querySelectorAll('pre.logs div').length > 0")

    shot = tmp_path / "dashboard.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    if NOTES.is_dir():
        shutil.copy(shot, NOTES / "dashboard.png")

    # Cancel from the page: the first click arms the button, the second sends the request.
    button = page.get_by_role("button", name="Cancel job")
    button.click()
    page.get_by_role("button", name="Confirm cancel").click()
    page.wait_for_function("() => window.__trainq.job.cancel !== null")
    assert js(page, "window.__trainq.job.cancel") in ("cancelling", "cancelled")
    assert job_status(api, job_id) in ("cancelling", "cancelled")
    wait_for(lambda: job_status(api, job_id) == "cancelled", 60, "the job to be cancelled")
    page.locator('.title-row [data-status="cancelled"]').wait_for()
    page.wait_for_function("() => window.__trainq.job.streamState === 'closed'")

    assert all(url.startswith(api.url) for url in page.requests), page.requests
    assert page.errors == []


def test_long_history_is_downsampled(api: Api, dash_system: System, browser_page: Any) -> None:
    from trainer.events import Publisher

    total = 5_000  # more than the page asks for, so the API must downsample
    job_id = submit(api, "dash-long", queue=NO_WORKER_QUEUE)
    pub = Publisher(dash_system.redis_url, job_id, 1, "trainer", prefix=dash_system.prefix)
    for step in range(1, total + 1):
        pub.emit(
            "metric",
            {
                "step": step,
                "steps": total,
                "loss": 5.0 / (1 + step / 500),
                "lr": 3e-4,
                "tokens_per_s": 1e5 + step,
                "mfu": None,
            },
        )
    assert pub.close(timeout=60)

    def ingested() -> bool:
        with api.client() as client:
            body = client.get(f"/v1/jobs/{job_id}/metrics", params={"max_points": 10}).json()
        return bool(body["total"] == total)

    wait_for(ingested, 90, f"{total} metric rows to be ingested", every=0.5)

    page = browser_page
    page.goto(f"/#/jobs/{job_id}")
    page.wait_for_function(
        "() => window.__trainq.job && window.__trainq.job.firstRenderMs !== null"
    )
    state = js(
        page,
        "({requested: __trainq.job.historyRequested, received: __trainq.job.historyReceived,"
        " drawn: __trainq.job.chartPoints().loss, downsampled: __trainq.job.historyDownsampled})",
    )
    assert state["requested"] == HISTORY_POINTS
    assert state["downsampled"] is True
    assert 100 <= state["received"] <= HISTORY_POINTS
    assert state["drawn"] <= HISTORY_POINTS
    # The newest step is in the downsampled history, so the chart ends where the run is.
    assert js(page, "Math.max(...window.__trainq.job.steps())") == total


def test_auth_on_token_entered_once(dash_browser: Any, dash_system: System, pg_url: str) -> None:
    from service.api.core.auth import create_token
    from service.api.core.db import make_engine, make_sessionmaker
    from service.api.core.settings import Settings

    secured = dash_system.start_api(auth=True)
    engine = make_engine(Settings(database_url=pg_url))
    with make_sessionmaker(engine).begin() as session:
        token = create_token(session, "dash-user")
    engine.dispose()
    secured.token = token
    job_id = submit(secured, "dash-auth", queue=NO_WORKER_QUEUE)

    context = dash_browser.new_context(base_url=secured.url)
    page = context.new_page()
    page.set_default_timeout(30_000)
    try:
        page.goto("/")
        dialog = page.locator("#token-dialog")
        dialog.wait_for(state="visible")
        page.fill("#token-input", token)
        page.click("#token-save")
        page.locator(f'tr[data-job-id="{job_id}"]').wait_for()
        assert js(page, "localStorage.getItem('trainq.token')") == token

        # A reload keeps the token: no prompt, the table loads straight away.
        page.reload()
        page.locator(f'tr[data-job-id="{job_id}"]').wait_for()
        assert js(page, "window.__trainq.authPrompts") == 0
        assert not dialog.is_visible()

        # The job page streams with the token too (fetch streaming sends the header), and
        # cancel works: a queued job is cancelled at once.
        page.goto(f"/#/jobs/{job_id}")
        page.wait_for_function("() => window.__trainq.job.streamState === 'open'")
        page.get_by_role("button", name="Cancel job").click()
        page.get_by_role("button", name="Confirm cancel").click()
        page.wait_for_function("() => window.__trainq.job.cancel === 'cancelled'")
        assert job_status(secured, job_id) == "cancelled"

        # A token the server does not know brings the prompt back, with an error.
        page.evaluate("() => localStorage.setItem('trainq.token', 'tq_not-a-token')")
        page.goto("/")
        page.reload()
        dialog.wait_for(state="visible")
        assert page.locator("#token-error").is_visible()
    finally:
        context.close()


def test_datasets_checkpoints_and_generate_box(api: Api, worker: object, browser_page: Any) -> None:
    """The #15 views in the browser: an uploaded dataset listed as ready (a chat dataset with
    its report, #24), a finished job's checkpoints table with its download links, and the
    generate box streaming the same greedy text the API answers without streaming."""
    page = browser_page
    corpus = ("the quick brown fox jumps over the lazy dog. " * 200).encode()
    with api.client() as client:
        up = client.post("/v1/datasets", params={"name": "dash-fox"}, content=corpus)
        assert up.status_code in (201, 202), up.text
        chats = "\n".join(
            json.dumps({"messages": [{"role": "user", "content": f"{i} plus 1?"},
                                     {"role": "assistant", "content": f"{i + 1}."}]})
            for i in range(30)
        ).encode()  # fmt: skip
        params = {"name": "dash-chats", "format": "chat"}
        assert client.post("/v1/datasets", params=params, content=chats).status_code == 202
        wait_for(
            lambda: client.get("/v1/datasets/dash-fox").json()["status"] == "ready",
            60,
            "the dataset to be ready",
        )
        train = {**TRAIN, "steps": 6, "data": {"dataset": "dash-fox"}}
        train["checkpoint"] = {"every": 3, "hf": "final"}
        r = client.post("/v1/jobs", json={"name": "dash-done", "queue": "cpu", "train": train})
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        wait_for(lambda: job_status(api, job_id) == "succeeded", 120, "the job to succeed", 0.5)
        body = {"model": job_id, "prompt": "the quick", "max_tokens": 12, "temperature": 0}
        answer = client.post("/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        greedy = answer.json()["choices"][0]["text"]

    page.goto("/#/datasets")
    row = page.locator('tr[data-dataset="dash-fox"]')
    row.wait_for()
    assert "ready" in row.inner_text()
    # A chat dataset's report under its name: what `trainq data upload --wait` prints.
    with api.client() as client:
        report = client.get("/v1/datasets/dash-chats").json()["report"]
    shown = page.locator('tr[data-dataset="dash-chats"] .sft-report')
    shown.wait_for()
    text = shown.inner_text()
    assert text.startswith("30 examples") and f"longest {report['longest']}" in text
    assert f"{100 * report['loss_share']:.1f}% of" in text and "dropped: none" in text
    assert f"packed {100 * report['packing_efficiency']:.1f}%" in text

    page.goto(f"/#/jobs/{job_id}")
    page.locator('.checkpoints tr[data-step="6"]').wait_for()
    assert page.locator(".checkpoints tr[data-step]").count() == 2  # steps 3 and 6
    assert page.locator('.checkpoints tr[data-step="6"] [data-format="hf"]').count() == 1
    assert page.locator('.checkpoints tr[data-step="3"] [data-format="hf"]').count() == 0

    page.locator(".gen-prompt").fill("the quick")
    box = page.locator(".gen-prompt").locator("xpath=ancestor::section[1]")
    box.locator('input[type="number"]').nth(0).fill("12")
    box.locator('input[type="number"]').nth(1).fill("0")
    page.get_by_role("button", name="Generate").click()
    page.wait_for_function(
        "t => document.querySelector('.gen-output').textContent === t", arg=greedy
    )
    assert all(url.startswith(api.url) for url in page.requests), page.requests
    assert page.errors == []
