"""Upload -> ready for a byte-level text corpus, against ``python -m trainer.prepare`` on it.

    .venv/bin/python bench/datasets_upload.py [--mb 100] [--rounds 2]

Generates a UTF-8 corpus of ``--mb`` MB (words drawn from a fixed vocabulary, some of them
multi-byte, lines of varied length; seeded), stands up the service (fresh PostgreSQL,
claimed Redis numbers, a non-admin token, uvicorn ``create_app``) and, alternated A B / B A:

- service: ``POST /v1/datasets?name=...`` streaming the file from disk (httpx, 1 MiB
  chunks), then ``GET /v1/datasets/{name}`` every 100 ms until ``ready``: from the first
  byte sent to ``ready`` seen at the client;
- bare: ``python -m trainer.prepare --out DIR FILE`` as a subprocess, start to exit (the
  interpreter's start included, as the service's preparing child pays it too).

Both produce the same shards (checked: the token counts agree). Prints the wall times,
MB/s and the ratio bare / service. Goal (issue 15): >= 0.8.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
import numpy as np
from _util import REPO, SHARED_CORES_NOTE, alternate, base_env, median, stack, verdict

GOAL = 0.8
CHUNK = 1 << 20


def make_corpus(path: Path, mb: int, seed: int = 0) -> int:
    """``mb`` MB of UTF-8 text: seeded words (a few multi-byte), lines of 5 to 25 words."""
    rng = np.random.default_rng(seed)
    letters = [*"abcdefghijklmnopqrstuvwxyz", "é", "ñ", "ü", "ß", "ø"]
    words = ["".join(rng.choice(letters, size=int(rng.integers(2, 10)))) for _ in range(5000)]
    target = mb * 1_000_000
    written = 0
    with path.open("w", encoding="utf-8") as f:
        while written < target:
            picks = rng.integers(0, len(words), size=20_000)
            cuts = np.cumsum(rng.integers(5, 26, size=2000))
            out = []
            start = 0
            for cut in cuts:
                if cut > len(picks):
                    break
                out.append(" ".join(words[i] for i in picks[start:cut]))
                start = cut
            block = "\n".join(out) + "\n"
            f.write(block)
            written += len(block.encode("utf-8"))
    return path.stat().st_size


def chunks(path: Path) -> Iterator[bytes]:
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            yield chunk


def via_service(url: str, auth: dict[str, str], corpus: Path) -> tuple[float, int]:
    name = f"bench-{uuid.uuid4().hex[:8]}"
    size = corpus.stat().st_size
    headers = {**auth, "Content-Length": str(size), "Content-Type": "application/octet-stream"}
    with httpx.Client(base_url=url, timeout=httpx.Timeout(30.0, read=600.0)) as client:
        start = time.perf_counter()
        resp = client.post(
            "/v1/datasets", params={"name": name}, content=chunks(corpus), headers=headers
        )
        if resp.status_code != 202:
            raise RuntimeError(f"upload answered {resp.status_code}: {resp.text}")
        while True:
            found = client.get(f"/v1/datasets/{name}", headers=auth).json()
            if found["status"] == "ready":
                break
            if found["status"] == "failed":
                raise RuntimeError(f"dataset failed: {found['reason']}")
            time.sleep(0.1)
        took = time.perf_counter() - start
        client.delete(f"/v1/datasets/{name}", headers=auth)  # frees the owner's quota
    return took, int(found["train_tokens"] + found["val_tokens"])


def via_prepare(corpus: Path, tmp: Path) -> tuple[float, int]:
    out = tmp / f"bare-{uuid.uuid4().hex[:8]}"
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "trainer.prepare", "--out", str(out), str(corpus)],
        env=base_env(),
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    took = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(done.stderr)
    import json

    meta = json.loads((out / "meta.json").read_text())
    shutil.rmtree(out)
    return took, int(meta["train_tokens"] + meta["val_tokens"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=int, default=100)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="trainq-bench-data-"))
    try:
        corpus = tmp / "corpus.txt"
        size = make_corpus(corpus, args.mb)
        print(f"corpus: {size / 1e6:.1f} MB of UTF-8 text (byte-level: {size:,} tokens)")
        with stack("bench-data") as s:
            server = s.serve_api(1, TRAINQ_DATASET_MAX_UPLOAD_BYTES=str(4 * size))
            results = alternate(
                args.rounds,
                {
                    "service": lambda: via_service(server.url, s.auth, corpus),
                    "bare": lambda: via_prepare(corpus, tmp),
                },
            )
        for runs_of in results.values():
            assert all(tokens == size for _, tokens in runs_of), runs_of
        svc = median([t for t, _ in results["service"]])
        bare = median([t for t, _ in results["bare"]])
        print(f"{'':32}{'wall s (median)':>16}{'MB/s':>10}   runs")
        for label, took, side in (
            ("upload -> ready (service)", svc, "service"),
            ("python -m trainer.prepare", bare, "bare"),
        ):
            runs = ", ".join(f"{t:.2f}" for t, _ in results[side])
            print(f"{label:32}{took:>16.2f}{size / 1e6 / took:>10.1f}   {runs}")
        ratio = bare / svc
        print(f"ratio bare / service: {ratio:.2f}  (goal >= {GOAL}: {verdict(ratio >= GOAL)})")
        print(SHARED_CORES_NOTE)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
