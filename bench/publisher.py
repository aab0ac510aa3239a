"""CPU cost of sending a batch of metric events: trainer.events.Publisher against redis-py's
pipeline doing the same MULTI of XADDs.

    .venv/bin/python bench/publisher.py [--batch 10] [--sends 200] [--rounds 10]

The Publisher runs inside the training process (rank 0) and sends what the steps emitted,
coalesced, every ``min_interval_s`` (0.2 s): at ~50 steps/s a batch of ~10 metric events,
each appended to ``{prefix}:events`` and to the job's stream in one MULTI. Its CPU there is
taken from the training loop, with the GIL held. Both sides send the very same events to the
same Redis (a claimed database number on 127.0.0.1:6379), one after the other in alternating
rounds (A B / B A, so drift hits both alike); each round times ``--sends`` sends with the
sending thread's own CPU clock. The reference is what the Publisher did before it packed its
commands itself: ``client.pipeline(transaction=True)``, ``xadd`` twice per event, ``execute``.

Prints the median CPU per send of each, and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import redis  # noqa: E402

from bench._util import alternate  # noqa: E402
from tests.conftest import RedisDBs  # noqa: E402
from trainer.events import Event, Keys, Publisher  # noqa: E402


def metric(step: int) -> Event:
    """A metric event as the trainer emits it (the fields of trainer.metrics' records)."""
    data: dict[str, Any] = {
        "step": step, "total_steps": 100_000, "loss": 5.4321 - step * 1e-4, "lr": 3e-4,
        "grad_norm": 1.2345, "tokens_seen": 1024 * step, "tok_s": 51_234.5,
        "tok_s_per_device": 25_617.2, "step_s": 0.0201, "mfu": None, "val_loss": None,
        "time": time.time(),
    }  # fmt: skip
    return Event("metric", "bench-job", 1, "trainer", step, data)


def redis_py_send(client: redis.Redis, keys: Keys, batch: list[Event]) -> None:
    pipe = client.pipeline(transaction=True)
    for ev in batch:
        fields = ev.to_fields()
        pipe.xadd(keys.events, fields, maxlen=1_000_000, approximate=True)  # type: ignore[arg-type]
        pipe.xadd(keys.job(ev.job_id), fields, maxlen=10_000, approximate=True)  # type: ignore[arg-type]
    pipe.execute()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=10, help="events per send")
    p.add_argument("--sends", type=int, default=200, help="sends timed per round")
    p.add_argument("--rounds", type=int, default=10)
    a = p.parse_args()
    dbs = RedisDBs()
    try:
        url = dbs.url(dbs.claim())
        client = redis.Redis.from_url(url)
        keys = Keys("bench-publisher")
        pub = Publisher(url, "bench-job", 1, "trainer", prefix=keys.prefix)
        assert pub.flush(timeout=10)  # connected
        batch = [metric(i) for i in range(1, a.batch + 1)]

        def timed(send: Any) -> float:
            t0 = time.thread_time()
            for _ in range(a.sends):
                send(batch)
            return (time.thread_time() - t0) / a.sends

        sides = {
            "redis-py pipeline": lambda: timed(lambda b: redis_py_send(client, keys, b)),
            "Publisher": lambda: timed(pub._send),
        }
        # Both sides write the same entries: one send each into empty streams, compared.
        written = []
        for send in (pub._send, lambda b: redis_py_send(client, keys, b)):
            client.delete(keys.events, keys.job("bench-job"))
            send(batch)
            written.append(
                [[f for _, f in client.xrange(k)] for k in (keys.events, keys.job("bench-job"))]
            )
        assert written[0] == written[1] and len(written[0][1]) == a.batch, "the sides differ"
        out = alternate(a.rounds, sides)
        ref, ours = (statistics.median(out[n]) * 1000 for n in sides)
        print(
            f"CPU per send of {a.batch} metric events (2 XADDs each, one MULTI), medians of "
            f"{a.rounds} rounds x {a.sends} sends:"
        )
        print(
            f"  redis-py pipeline {ref:.3f} ms   Publisher {ours:.3f} ms   ratio {ref / ours:.2f}x"
        )
        print(
            f"  at 5 sends/s (the Publisher's 0.2 s interval) that is {5 * ref:.1f} vs "
            f"{5 * ours:.1f} ms of CPU per second in the training process"
        )
        pub.close(timeout=5)
    finally:
        dbs.release()


if __name__ == "__main__":
    main()
