"""Rank 0's copy of a run to the experiment trackers a spec names (``train.tracking``).

What goes out: the parameters (the resolved spec, flattened to dotted keys), every metric
record trainq itself logs (the numbers ``GET /v1/jobs/{id}/metrics`` returns, with their
step and time), and the final checkpoint's location (a tag). Weights & Biases and MLflow
are optional packages (the ``track`` extra), imported only here, on rank 0, when configured.

A tracker never fails or slows the job: the training thread only puts records on each
tracker's bounded queue, and that tracker's own background thread connects, sends, and
drops. When its queue is full, or it fails (down, slow, refused, not installed), its records
are dropped (from then on, for a failure) with ONE warning line on stderr for that tracker;
the run's end waits for them at most ``CLOSE_S``. An MLflow URI is an outbound
URL (``trainer.outbound``): checked again here, with its name resolved, before the client
connects (the client resolves the name again itself: a DNS answer that changes in between
is the gap that remains).
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
from pathlib import Path
from typing import Any, Protocol

from trainer.config import MlflowConfig, TrackingConfig, WandbConfig
from trainer.outbound import OutboundRefused, check_url, pinned_addresses

__all__ = ["CLOSE_S", "QUEUE_SIZE", "Tracker", "abandoned", "flatten"]

QUEUE_SIZE = 10_000  # records waiting for a tracker's sender; past it they are dropped
# How long the end of a run waits for the trackers to send what they have queued (their
# client libraries start slowly: importing mlflow and starting wandb take seconds each).
CLOSE_S = 30.0
_SKIP = ("step", "steps", "time")  # the step is the x axis, time the timestamp
_STOP = object()
# Set when a run's end gave up on a tracker: its library may still hold the interpreter's
# exit (wandb's atexit teardown waits for its service, ~90 s when the server is unreachable),
# so trainer.__main__ then exits without running atexit handlers (see ``abandoned``).
_ABANDONED = threading.Event()


def abandoned() -> bool:
    """Whether this process gave up on a tracker that may still be at work."""
    return _ABANDONED.is_set()


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """A nested mapping as dotted keys (``optim.lr``); lists as JSON text, None as "null"."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(flatten(item, f"{prefix}{key}."))
        return out
    key = prefix[:-1]
    if isinstance(value, list):
        return {key: json.dumps(value)}
    return {key: "null" if value is None else value}


def metric_values(record: dict[str, Any]) -> dict[str, float]:
    """A metric record's numbers (nulls, the step and the time left out)."""
    return {
        k: float(v)
        for k, v in record.items()
        if k not in _SKIP and isinstance(v, int | float) and not isinstance(v, bool)
    }


class _Backend(Protocol):
    name: str

    def start(self, params: dict[str, Any]) -> None: ...
    def log(self, records: list[dict[str, Any]]) -> None: ...
    def tag(self, tags: dict[str, str]) -> None: ...
    def close(self) -> None: ...


class _Mlflow:
    name = "mlflow"

    def __init__(self, cfg: MlflowConfig, run_name: str, tags: dict[str, str], allow: bool):
        self.cfg, self.run_name, self.tags, self.allow = cfg, run_name, tags, allow
        self.client: Any = None
        self.run_id = ""

    def start(self, params: dict[str, Any]) -> None:
        parts = check_url(self.cfg.tracking_uri, allow_private=self.allow)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        pinned_addresses(parts.hostname or "", port, allow_private=self.allow)
        # The client's own retries (7, backing off for minutes) and 120 s timeout would
        # hold this thread, not the job; still, a tracker that is down should say so soon.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.cfg.tracking_uri)
        experiment = self._experiment()
        run = self.client.create_run(experiment, run_name=self.run_name, tags=self.tags)
        self.run_id = run.info.run_id
        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):  # the REST API takes 100 params a batch
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def _experiment(self) -> str:
        """The experiment's id, made when missing (another run may make it meanwhile)."""
        from mlflow.exceptions import MlflowException

        found = self.client.get_experiment_by_name(self.cfg.experiment)
        if found is not None:
            return str(found.experiment_id)
        try:
            return str(self.client.create_experiment(self.cfg.experiment))
        except MlflowException:
            found = self.client.get_experiment_by_name(self.cfg.experiment)
            if found is None:
                raise
            return str(found.experiment_id)

    def log(self, records: list[dict[str, Any]]) -> None:
        from mlflow.entities import Metric

        metrics = [
            Metric(key, value, int(r.get("time", time.time()) * 1000), int(r["step"]))
            for r in records
            for key, value in metric_values(r).items()
        ]
        for i in range(0, len(metrics), 1000):  # and 1000 metrics
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def tag(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in tags.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class _Wandb:
    name = "wandb"

    def __init__(self, cfg: WandbConfig, run_name: str, run_id: str, run_dir: Path):
        self.cfg, self.run_name, self.run_id, self.run_dir = cfg, run_name, run_id, run_dir
        self.run: Any = None

    def start(self, params: dict[str, Any]) -> None:
        import wandb

        self.run = wandb.init(
            project=self.cfg.project,
            entity=self.cfg.entity,
            name=self.run_name,
            id=self.run_id,
            tags=list(self.cfg.tags),
            mode=self.cfg.mode,
            dir=str(self.run_dir),  # offline: RUN_DIR/wandb/offline-run-*, for `wandb sync`
            config=params,
            resume="allow",
            settings=wandb.Settings(console="off", x_disable_stats=True, silent=True),
        )

    def log(self, records: list[dict[str, Any]]) -> None:
        for r in records:
            self.run.log(metric_values(r), step=int(r["step"]))

    def tag(self, tags: dict[str, str]) -> None:
        self.run.summary.update(tags)

    def close(self) -> None:
        self.run.finish()


class _Sender:
    """One tracker's bounded queue and the thread that drains it into the tracker."""

    def __init__(self, backend: _Backend, params: dict[str, Any], maxsize: int) -> None:
        self.backend = backend
        self.params = params
        self.queue: queue.Queue[Any] = queue.Queue(maxsize)
        self.warned = False  # at most one line for this tracker's trouble
        self.thread = threading.Thread(target=self._send, name=f"tracking-{backend.name}")
        self.thread.daemon = True
        self.thread.start()

    def put(self, item: Any) -> None:
        try:
            self.queue.put_nowait(item)
        except queue.Full:
            self.warn(
                f"{self.backend.name} falls behind ({self.queue.maxsize} records waiting);"
                " records are dropped while its queue is full"
            )

    def stop(self, deadline: float) -> bool:
        """Send what is queued, by ``deadline`` (time.monotonic); False if not done by then."""
        try:
            self.queue.put(_STOP, timeout=max(0.0, deadline - time.monotonic()))
        except queue.Full:
            pass
        else:
            self.thread.join(max(0.0, deadline - time.monotonic()))
        return not self.thread.is_alive()

    def _send(self) -> None:
        live = self._call("start", self.params)
        while True:
            batch = [self.queue.get()]
            while batch[-1] is not _STOP and len(batch) < 1000:  # one request for many steps
                try:
                    batch.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            items = [x for x in batch if x is not _STOP]
            logs = [x[1] for x in items if x[0] == "log"]
            if live and logs:
                live = self._call("log", logs)
            for tags in (x[1] for x in items if x[0] == "tag"):
                live = live and self._call("tag", tags)
            if batch[-1] is _STOP:
                if live:
                    self._call("close")
                return

    def _call(self, what: str, *args: Any) -> bool:
        name = self.backend.name
        try:
            getattr(self.backend, what)(*args)
        except ModuleNotFoundError as exc:
            self.warn(f"{name}: {exc.name} is not installed on this worker"
                      " (pip install 'trainq[track]'); nothing is sent to it")  # fmt: skip
            return False
        except OutboundRefused as exc:
            self.warn(f"{name}: tracking_uri refused: {exc}; nothing is sent to it")
            return False
        except Exception as exc:  # down, refused, slow: the job goes on without it
            line = next((ln for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
            self.warn(f"{name} failed ({type(exc).__name__}: {line[:300]}) in {what};"
                      " its records are dropped from here on")  # fmt: skip
            return False
        return True

    def warn(self, line: str) -> None:
        if not self.warned:
            self.warned = True
            print(f"trainer: tracking: warning: {line}", file=sys.stderr, flush=True)


class Tracker:
    """The trackers of one run, each with its own queue and thread, so that one that is
    slow holds up neither the job nor the other; every method returns at once."""

    def __init__(
        self,
        cfg: TrackingConfig,
        params: dict[str, Any],
        run_dir: Path,
        *,
        job_id: str,
        attempt: int,
        allow_private: bool = False,
        maxsize: int = QUEUE_SIZE,
    ) -> None:
        tags = {"trainq.job_id": job_id, "trainq.attempt": str(attempt)}
        backends: list[_Backend] = []
        if cfg.mlflow is not None:
            name = cfg.mlflow.run_name or f"{job_id}-{attempt}"
            backends.append(_Mlflow(cfg.mlflow, name, tags, allow_private))
        if cfg.wandb is not None:
            name = cfg.wandb.name or job_id
            backends.append(_Wandb(cfg.wandb, name, f"{job_id}-{attempt}", run_dir))
        self._senders = [_Sender(b, params, maxsize) for b in backends]

    def log(self, record: dict[str, Any]) -> None:
        for sender in self._senders:
            sender.put(("log", record))

    def tag(self, tags: dict[str, str]) -> None:
        for sender in self._senders:
            sender.put(("tag", tags))

    def close(self, timeout: float = CLOSE_S) -> bool:
        """Send what is queued, within ``timeout`` seconds in all; False if that was not
        enough for some tracker (its rest is dropped, with its one warning line)."""
        deadline = time.monotonic() + timeout
        done = True
        for sender in self._senders:
            if not sender.stop(deadline):
                done = False
                _ABANDONED.set()
                sender.warn(f"{sender.backend.name} did not finish within {timeout:.0f}s"
                            " of the run's end; the rest is dropped")  # fmt: skip
        return done
