"""One attempt, from claim to exit event: the plain function behind the Celery task.

The way through: claim (SET NX; a redelivery stops here) -> heartbeat -> checks that need no
process (shutdown, cancel flag, job id, data path) -> write RUN_DIR/config.json -> launch
guard + torchrun in a new session -> forward logs, watch cancel / deadline / shutdown ->
stop the whole process group if asked (SIGTERM, grace, SIGKILL) -> confirm by the process
table that nothing of the group is left -> flush the logs -> report the exit.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from trainer.config import ConfigError, resolve_data_path
from trainer.events import Publisher
from worker.context import Slot, WorkerContext
from worker.launch import build_env, build_guard_argv, build_torchrun_argv, safe_job_id
from worker.logs import LogForwarder
from worker.message import JobMessage
from worker.outcome import Outcome, classify, read_exit_json
from worker.procs import kill_group, signal_group, wait_group_gone
from worker.watchers import CancelWatch, Heartbeat

__all__ = ["run_attempt"]

log = logging.getLogger(__name__)

CLAIM_TTL_S = 7 * 24 * 3600
_CLAIM_RETRY_S = 30.0  # Redis briefly away at claim time: wait for it rather than drop the task


def _claim(ctx: WorkerContext, msg: JobMessage) -> bool:
    key = ctx.keys.claim(msg.job_id, msg.attempt)
    deadline = time.monotonic() + _CLAIM_RETRY_S
    while True:
        try:
            return bool(ctx.redis.set(key, ctx.name, nx=True, ex=CLAIM_TTL_S))
        except Exception as exc:
            if time.monotonic() >= deadline:
                raise
            log.warning("claim of %s:%d waits for Redis: %s", msg.job_id, msg.attempt, exc)
            time.sleep(1.0)


def run_attempt(msg: JobMessage, ctx: WorkerContext) -> Outcome | None:
    """Run one attempt to its end; None if another delivery already claimed it."""
    if not _claim(ctx, msg):
        log.warning(
            "attempt %s:%d is already claimed; duplicate delivery ignored", msg.job_id, msg.attempt
        )
        return None
    s = ctx.settings
    pub = Publisher(s.redis_url, msg.job_id, msg.attempt, "worker", prefix=s.redis_prefix)
    hb = Heartbeat(
        ctx.redis, ctx.keys.heartbeat(msg.job_id, msg.attempt), ctx.name, s.heartbeat_ttl_s
    )
    wake = threading.Event()
    ctx.track(msg.job_id, msg.attempt, wake)
    try:
        with ctx.slot() as slot:
            try:
                outcome = _Attempt(msg, ctx, pub, slot, wake).run()
            except Exception as exc:  # our own fault, not the run's: the service retries
                log.exception("attempt %s:%d failed in the worker", msg.job_id, msg.attempt)
                outcome = Outcome(None, "lost", f"worker {ctx.name} failed: {exc}")
        pub.emit("lifecycle", outcome.data())
        sent = pub.close(s.flush_timeout_s)
        if not sent:
            log.error(
                "attempt %s:%d: %d events not sent (Redis unreachable)",
                msg.job_id,
                msg.attempt,
                pub.pending(),
            )
        # Keep the heartbeat if the exit event is still unsent: it expires on its own.
        hb.stop(delete=sent)
    finally:
        ctx.untrack(msg.job_id, msg.attempt)
    log.info("attempt %s:%d exited: %s", msg.job_id, msg.attempt, outcome)
    return outcome


class _Attempt:
    def __init__(
        self,
        msg: JobMessage,
        ctx: WorkerContext,
        pub: Publisher,
        slot: Slot,
        wake: threading.Event,
    ) -> None:
        self.msg, self.ctx, self.pub, self.slot, self.wake = msg, ctx, pub, slot, wake
        self.s = ctx.settings
        self.cancel = CancelWatch(
            ctx.redis,
            key=ctx.keys.cancel(msg.job_id),
            channel=ctx.keys.cancel_channel(),
            job_id=msg.job_id,
            poll_s=self.s.cancel_poll_s,
            wake=wake,
        )

    def run(self) -> Outcome:
        early = self._refuse()
        if early is not None:
            return early
        run_dir = (self.s.runs_root / self.msg.job_id).resolve()
        self._prepare(run_dir)
        self.cancel.start()
        try:
            return self._launch_and_watch(run_dir)
        finally:
            self.cancel.stop()

    def _refuse(self) -> Outcome | None:
        """Reasons not to launch at all, found without starting a process."""
        msg, ctx = self.msg, self.ctx
        if ctx.preempt.is_set():
            return Outcome(None, "preempted", f"worker {ctx.name} is shutting down")
        if self.cancel.check():
            return Outcome(None, "cancelled", "cancelled before launch")
        if not safe_job_id(msg.job_id):
            return Outcome(None, "spec_error", f"job id {msg.job_id!r} cannot name a run folder")
        if msg.nodes != 1:
            return Outcome(
                None, "spec_error", f"nodes={msg.nodes}: this worker launches single-node jobs only"
            )
        gpus = self.slot.gpus
        if gpus is not None and msg.procs_per_node > len(gpus):
            return Outcome(
                None,
                "spec_error",
                f"procs_per_node={msg.procs_per_node} but a slot of worker "
                f"{ctx.name} has {len(gpus)} GPU(s)",
            )
        path = msg.train.data.path
        try:
            data = resolve_data_path(path, self.s.data_root)
        except ConfigError as exc:
            return Outcome(None, "spec_error", str(exc))
        if not data.is_dir():
            return Outcome(
                None,
                "spec_error",
                f"data.path {path!r}: no such folder under the data root of worker {ctx.name}",
            )
        return None

    def _prepare(self, run_dir: Path) -> None:
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        # A retry shares the run dir: an old attempt's failure must not classify this one.
        (run_dir / "exit.json").unlink(missing_ok=True)
        tmp = run_dir / ".config.json.tmp"
        tmp.write_text(
            json.dumps(self.msg.train.model_dump(mode="json"), indent=2) + "\n", encoding="utf-8"
        )
        os.replace(tmp, run_dir / "config.json")

    def _launch_and_watch(self, run_dir: Path) -> Outcome:
        s, msg, ctx = self.s, self.msg, self.ctx
        python = s.python or sys.executable
        torchrun = build_torchrun_argv(
            python,
            nnodes=1,
            nproc_per_node=msg.procs_per_node,
            max_restarts=s.max_restarts,
            config=run_dir / "config.json",
            run_dir=run_dir,
            data_root=s.data_root.resolve(),
            log_dir=run_dir / "logs",
        )
        env = build_env(
            os.environ,
            gpus=self.slot.gpus,
            redis_url=s.redis_url,
            redis_prefix=s.redis_prefix,
            job_id=msg.job_id,
            attempt=msg.attempt,
        )
        # stdin is the guard's lifeline: only this process holds its write end.
        proc = subprocess.Popen(
            build_guard_argv(python, torchrun),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=run_dir,
            start_new_session=True,
        )
        pgid = proc.pid  # the guard leads the new session and its process group
        self.pub.emit(
            "lifecycle", {"phase": "running", "host": ctx.host, "worker": ctx.name, "pid": proc.pid}
        )
        logs = LogForwarder(
            self.pub,
            batch_lines=s.log_batch_lines,
            batch_s=s.log_batch_s,
            tail_lines=s.log_tail_lines,
        )
        assert proc.stdout is not None and proc.stderr is not None and proc.stdin is not None
        logs.attach(proc.stdout, "stdout")
        logs.attach(proc.stderr, "stderr")
        exited = threading.Event()

        def wait_exit() -> None:
            # WNOWAIT leaves the guard a zombie, so its pid (the pgid) cannot be reused
            # while we still signal the group.
            os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
            exited.set()
            self.wake.set()

        threading.Thread(target=wait_exit, name=f"wait-{proc.pid}", daemon=True).start()
        stop_reason, stop_message = None, ""
        try:
            stop_reason, stop_message = self._watch(exited)
            if stop_reason is not None:
                self._stop_group(pgid, exited)
        finally:
            # Whatever happened above, nothing of the run outlives the attempt.
            if not exited.is_set():
                signal_group(pgid, signal.SIGKILL)
                exited.wait(10)
            if not kill_group(pgid):
                log.error("process group %d of %s survived SIGKILL", pgid, msg.job_id)
            code = proc.wait()
            proc.stdin.close()
            logs.close()
        return classify(
            code,
            stop_reason=stop_reason,
            stop_message=stop_message,
            exit_info=read_exit_json(run_dir),
            agent_lines=logs.agent,
            tail=logs.tail,
        )

    def _watch(self, exited: threading.Event) -> tuple[str | None, str]:
        msg, ctx = self.msg, self.ctx
        limit = msg.max_runtime_s
        deadline = time.monotonic() + limit if limit else None
        while not exited.is_set():
            timeout = self.s.cancel_poll_s
            if deadline is not None:
                timeout = max(0.0, min(timeout, deadline - time.monotonic()))
            self.wake.wait(timeout)
            self.wake.clear()
            if exited.is_set():
                break
            if ctx.preempt.is_set():
                return "preempted", (
                    f"worker {ctx.name} shut down; the run was stopped "
                    f"to resume from its checkpoint elsewhere"
                )
            if self.cancel.requested.is_set():
                return "cancelled", "cancelled by request"
            if deadline is not None and time.monotonic() >= deadline:
                return "timeout", f"ran past max_runtime_s={limit}"
        return None, ""

    def _stop_group(self, pgid: int, exited: threading.Event) -> None:
        """SIGTERM to every process of the run (ranks checkpoint), then SIGKILL after grace."""
        grace = self.s.cancel_grace_s
        deadline = time.monotonic() + grace
        signal_group(pgid, signal.SIGTERM)
        # torchrun may exit before its ranks finish their checkpoint: wait for the group.
        exited.wait(grace)
        if not wait_group_gone(pgid, max(0.0, deadline - time.monotonic())):
            log.warning(
                "run %s still running %.0f s after SIGTERM; killing it", self.msg.job_id, grace
            )
            signal_group(pgid, signal.SIGKILL)
