"""trainer.metrics: what rank 0 logs reaches metrics.jsonl and, on flush, a real Redis."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest
import redis

from trainer.env import TrainerEnv
from trainer.events import Event, Keys
from trainer.metrics import MetricsLogger


def _record(step: int) -> dict[str, object]:
    return {"step": step, "steps": 10, "loss": 3.0 - step / 10, "lr": 1e-3}


def test_flush_puts_every_logged_step_on_the_wire(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis
) -> None:
    """The trainer flushes before each checkpoint: a run killed right after one keeps every
    metric up to it, although the publisher coalesces a stream of steps into one send per
    200 ms (it would otherwise still be holding steps 2-5 here)."""
    keys = Keys("tq-metrics-test")
    env = TrainerEnv(redis_url=redis_url, redis_prefix=keys.prefix, job_id="job-m")
    logger = MetricsLogger(tmp_path, env, enabled=True)
    try:
        for step in range(1, 6):
            logger.log(_record(step))
        assert logger.flush(timeout=5)
        sent = [Event.from_fields(f).data["step"] for _, f in redis_client.xrange(keys.events)]
        assert sent == [1, 2, 3, 4, 5]
    finally:
        logger.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4, 5]


def test_flush_does_not_wait_on_an_unreachable_redis(tmp_path: Path) -> None:
    with socket.socket() as s:  # free a moment ago, so nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = TrainerEnv(redis_url=f"redis://127.0.0.1:{port}/0", job_id="job-dead")
    logger = MetricsLogger(tmp_path, env, enabled=True)
    try:
        logger.log(_record(1))
        assert logger.flush(timeout=1) is False  # the first send fails: nothing was sent
        logger.log(_record(2))
        # Now the link is known to be down: the flush before a checkpoint does not wait.
        t0 = time.monotonic()
        assert logger.flush(timeout=60) is False
        assert time.monotonic() - t0 < 10
    finally:
        logger.close(timeout=0.1)
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


def _scalars(tb_dir: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)}


def test_tensorboard_curves_match_metrics_jsonl(single_run: Path) -> None:
    """The reference run (tensorboard installed) left curves that TensorBoard itself reads
    back: every logged step's loss, as in metrics.jsonl (float32 in the event file)."""
    from tests.trainer import runs

    losses = runs.losses(single_run)
    curve = _scalars(single_run / "tb", "loss")
    assert sorted(curve) == sorted(losses)
    for step, loss in losses.items():
        assert curve[step] == pytest.approx(loss, rel=1e-6)
    assert set(_scalars(single_run / "tb", "tokens_per_s")) == set(losses)


def test_a_written_checkpoint_goes_on_the_wire(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis
) -> None:
    """The event the service records as ``checkpoint.written`` (webhooks, the events feed)."""
    keys = Keys("tq-metrics-ckpt")
    env = TrainerEnv(redis_url=redis_url, redis_prefix=keys.prefix, job_id="job-c")
    logger = MetricsLogger(tmp_path, env, enabled=True)
    try:
        logger.log(_record(1))
        logger.checkpoint(1, "step-1")
        assert logger.flush(timeout=5)
        sent = [Event.from_fields(f) for _, f in redis_client.xrange(keys.events)]
        assert [(e.kind, e.source) for e in sent] == [
            ("metric", "trainer"),
            ("checkpoint", "trainer"),
        ]
        assert sent[1].data == {"step": 1, "checkpoint": "step-1"}
    finally:
        logger.close()
