"""Load generators of the service benchmarks: wrk for GETs, an asyncio client for POSTs."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# --- load generators -------------------------------------------------------------------

WRK_DONE = """
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '\\nWRKJSON {"requests":%d,"duration_us":%d,"connect":%d,"read":%d,"write":%d,'
    .. '"status":%d,"timeout":%d,"p50_ms":%.3f,"p90_ms":%.3f,"p99_ms":%.3f,'
    .. '"max_ms":%.3f,"mean_ms":%.3f}\\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50) / 1000, latency:percentile(90) / 1000,
    latency:percentile(99) / 1000, latency.max / 1000, latency.mean / 1000))
end
"""


def wrk(
    url: str,
    *,
    connections: int,
    duration_s: float,
    headers: dict[str, str] | None = None,
    tmp: Path,
) -> dict[str, float]:
    """GET ``url`` with wrk (one thread, keep-alive) for ``duration_s``; requests/s, latency."""
    if shutil.which("wrk") is None:
        raise SystemExit("wrk not found: apt-get install -y wrk")
    script = tmp / "wrk_done.lua"
    script.write_text(WRK_DONE)
    argv = ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(duration_s))}s", "--timeout", "5s"]
    for k, v in (headers or {}).items():
        argv += ["-H", f"{k}: {v}"]
    argv += ["-s", str(script), url]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=duration_s + 60)
    for line in out.stdout.splitlines():
        if line.startswith("WRKJSON "):
            r = json.loads(line[len("WRKJSON ") :])
            r["rps"] = r["requests"] / (r["duration_us"] / 1e6)
            r["errors"] = r["connect"] + r["read"] + r["write"] + r["status"] + r["timeout"]
            return r
    raise RuntimeError(f"wrk gave no result:\n{out.stdout}\n{out.stderr}")


@dataclass
class LoadResult:
    sent: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)
    elapsed_s: float = 0.0
    failures: int = 0  # connection errors, timeouts: no status at all

    def ok(self) -> int:
        return sum(n for s, n in self.statuses.items() if 200 <= s < 300)


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ", 2)[1])
    length = 0
    chunked = False
    for line in lines[1:]:
        k, _, v = line.partition(b":")
        k = k.strip().lower()
        if k == b"content-length":
            length = int(v)
        elif k == b"transfer-encoding" and b"chunked" in v.lower():
            chunked = True
    if not chunked:
        return status, await reader.readexactly(length)
    body = b""
    while True:
        size = int((await reader.readuntil(b"\r\n")).strip(), 16)
        chunk = await reader.readexactly(size + 2)
        if size == 0:
            return status, body
        body += chunk[:-2]


async def _post_load(
    port: int,
    path: str,
    make_body: Callable[[int], bytes],
    headers: dict[str, str],
    *,
    connections: int,
    total: int,
    max_s: float,
) -> LoadResult:
    result = LoadResult()
    counter = iter(range(total))
    deadline = time.monotonic() + max_s
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n" + "".join(
        f"{k}: {v}\r\n" for k, v in headers.items()
    )

    async def one_connection() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for i in counter:  # shared: each request index is taken exactly once
                if time.monotonic() > deadline:
                    return
                body = make_body(i)
                req = f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body
                t0 = time.perf_counter()
                result.sent += 1
                writer.write(req)
                try:
                    status, _ = await asyncio.wait_for(_read_response(reader), 10)
                except (TimeoutError, OSError, asyncio.IncompleteReadError):
                    result.failures += 1
                    return
                result.latencies.append(time.perf_counter() - t0)
                result.statuses[status] = result.statuses.get(status, 0) + 1
        finally:
            writer.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(one_connection() for _ in range(connections)))
    result.elapsed_s = time.perf_counter() - t0
    return result


def post_load(
    url: str,
    path: str,
    make_body: Callable[[int], bytes],
    headers: dict[str, str],
    *,
    connections: int,
    total: int,
    max_s: float,
) -> LoadResult:
    """POST ``total`` requests (at most ``max_s`` seconds) over keep-alive connections."""
    port = int(url.rsplit(":", 1)[1])
    try:
        import uvloop

        runner: Callable[..., Any] = uvloop.run
    except ImportError:
        runner = asyncio.run
    return runner(
        _post_load(
            port, path, make_body, headers, connections=connections, total=total, max_s=max_s
        )
    )
