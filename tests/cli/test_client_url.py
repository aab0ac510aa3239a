"""Where the client is pointed: a malformed TRAINQ_URL is a usage error, and a server that is
not trainq's API says so instead of passing for a trainq answer ("job not found")."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from service.cli.client import EXIT_UNREACHABLE, EXIT_USAGE
from tests.cli.conftest import Run, one_line


@pytest.mark.parametrize(
    "url, needle",
    [
        ("127.0.0.1:8000", "TRAINQ_URL must start with http:// or https://"),
        ("localhost:8000", "TRAINQ_URL must start with http:// or https://"),
        ("ftp://127.0.0.1:8000", "TRAINQ_URL must start with http:// or https://"),
        ("http://127.0.0.1:99999", "TRAINQ_URL has an invalid port"),
        ("http://", "TRAINQ_URL names no host"),
    ],
)
def test_a_malformed_url_is_a_usage_error(trainq: Run, url: str, needle: str) -> None:
    for args in (["status", "abc123"], ["ls"]):
        r = trainq(*args, url=url, timeout=60)
        assert r.code == EXIT_USAGE, r
        line = one_line(r.err)
        assert line.startswith(f"trainq: error: {needle}"), line
        assert "e.g. http://127.0.0.1:8000" in line and repr(url) in line


@pytest.fixture()
def plain_http(tmp_path: Path) -> Iterator[str]:
    """`python -m http.server` on a free loopback port, serving an empty folder: some other
    server at TRAINQ_URL. A true outside edge, not a stand-in for one of our components."""
    handler = partial(SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.mark.parametrize(
    "args, answered",
    [
        (["status", "abc123"], "GET /v1/jobs/abc123 answered HTTP 404"),  # not "job not found"
        (["cancel", "abc123"], "POST /v1/jobs/abc123/cancel answered HTTP 501"),
        (["logs", "abc123", "-f"], "GET /v1/jobs/abc123/logs answered HTTP 404"),
        (["ls"], "GET /v1/jobs answered HTTP 404"),
    ],
)
def test_a_server_that_is_not_trainq_says_so(
    trainq: Run, plain_http: str, args: list[str], answered: str
) -> None:
    r = trainq(*args, url=plain_http, timeout=60)
    assert r.code == EXIT_UNREACHABLE, r
    line = one_line(r.err)
    expected = f"URL {plain_http} is not a trainq API ({answered}); check TRAINQ_URL"
    assert line == f"trainq: error: {expected}"


def test_submit_to_a_server_that_is_not_trainq(
    trainq: Run, plain_http: str, tmp_path: Path
) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text("name: x\nqueue: cpu\n")
    r = trainq("submit", str(spec), "--wait", url=plain_http, timeout=60)
    assert r.code == EXIT_UNREACHABLE, r
    assert "is not a trainq API (POST /v1/jobs answered HTTP 501)" in one_line(r.err)
