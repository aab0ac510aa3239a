"""train.tracking's spec rules and trainer.tracking's promise: a tracker never fails or
slows the job (a bounded queue, dropped with one warning line)."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import pytest

from trainer.config import ConfigError, TrackingConfig, load_config
from trainer.tracking import Tracker, flatten

KEY = "0123456789abcdef0123456789abcdef01234567"  # the shape of a W&B API key


@pytest.mark.parametrize(
    ("tracking", "field"),
    [
        ({"wandb": {"project": "p", "api_key": KEY}}, "api_key"),
        ({"wandb": {"project": "p", "name": KEY}}, "looks like an API key"),
        ({"wandb": {"project": "p", "tags": ["ok", f"wandb_v1_{KEY}"]}}, "looks like an API key"),
        ({"mlflow": {"tracking_uri": "http://u:pw@example.com/"}}, "credentials"),
        ({"mlflow": {"tracking_uri": "http://example.com/", "token": "x"}}, "token"),
        ({"mlflow": {"tracking_uri": "http://example.com/?access_token=x"}}, "query"),
        ({"mlflow": {"tracking_uri": "file:///tmp/mlruns"}}, "http"),
        ({"mlflow": {"tracking_uri": "http://169.254.169.254/"}}, "metadata"),
        ({"wandb": {"project": "a/b"}}, "project"),
    ],
)
def test_keys_and_bad_uris_are_refused_naming_the_field(
    tracking: dict[str, Any], field: str
) -> None:
    with pytest.raises(ConfigError, match="tracking") as info:
        load_config({"tracking": tracking})
    assert field in str(info.value)


def test_a_valid_tracking_spec_loads() -> None:
    cfg = load_config(
        {
            "tracking": {
                "wandb": {"project": "p", "name": "run 1", "tags": ["a"], "mode": "online"},
                "mlflow": {"tracking_uri": "https://mlflow.example.com", "experiment": "e"},
            }
        }
    )
    assert cfg.tracking is not None and cfg.tracking.wandb is not None
    flat = flatten(cfg.model_dump(mode="json"))
    assert flat["tracking.wandb.tags"] == '["a"]' and flat["optim.lr"] == cfg.optim.lr


def _closed_url() -> str:
    with socket.socket() as s:  # free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_a_tracker_that_is_down_warns_once_and_never_blocks(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("mlflow")
    cfg = TrackingConfig.model_validate({"mlflow": {"tracking_uri": _closed_url()}})
    tracker = Tracker(cfg, {"a": 1}, tmp_path, job_id="j", attempt=1, allow_private=True)
    t0 = time.perf_counter()
    for step in range(1, 2001):
        tracker.log({"step": step, "loss": 1.0 / step, "time": time.time()})
    tracker.tag({"trainq.checkpoint": "x"})
    assert time.perf_counter() - t0 < 1.0  # the training thread only queues
    assert tracker.close(timeout=30)
    err = capfd.readouterr().err
    lines = [ln for ln in err.splitlines() if "trainer: tracking: warning" in ln]
    assert len(lines) == 1 and "mlflow failed" in lines[0], err


def test_a_private_uri_is_refused_in_the_run_without_the_setting(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    cfg = TrackingConfig.model_validate({"mlflow": {"tracking_uri": "http://127.0.0.1:9/"}})
    tracker = Tracker(cfg, {}, tmp_path, job_id="j", attempt=1)
    tracker.log({"step": 1, "loss": 1.0})
    assert tracker.close(timeout=10)
    err = capfd.readouterr().err
    assert err.count("trainer: tracking: warning") == 1 and "refused" in err, err


def test_a_slow_tracker_fills_the_queue_and_drops_with_one_warning(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    with socket.socket() as slow:  # listens, never answers: every request waits its timeout
        slow.bind(("127.0.0.1", 0))
        slow.listen(16)
        url = f"http://127.0.0.1:{slow.getsockname()[1]}"
        cfg = TrackingConfig.model_validate({"mlflow": {"tracking_uri": url}})
        tracker = Tracker(cfg, {}, tmp_path, job_id="j", attempt=1, allow_private=True, maxsize=50)
        t0 = time.perf_counter()
        for step in range(1, 5001):
            tracker.log({"step": step, "loss": 1.0})
        assert time.perf_counter() - t0 < 1.0  # dropped, not waited for
        assert tracker.close(timeout=20)
    err = capfd.readouterr().err
    assert err.count("trainer: tracking: warning") == 1 and "falls behind" in err, err
