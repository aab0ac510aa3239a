"""One attempt, from claim to exit event: the plain function behind the Celery task.

The way through: claim (SET NX; a redelivery stops here) -> heartbeat -> checks that need no
process (shutdown, cancel flag, job id, data path) -> write RUN_DIR/config.json -> (several
nodes: wait for the whole gang, worker.gang) -> launch guard + torchrun in a new session ->
forward logs, watch cancel / deadline / shutdown -> stop the whole process group if asked
(SIGTERM, grace, SIGKILL) -> confirm by the process table that nothing of the group is left
-> flush the logs -> report the exit.

The run folder is group-readable at most (trainer.files): the worker makes its folders and
config.json with those modes and starts the run with the matching umask.

A job of N nodes is N tasks, one per node (``msg.node_rank``), each with its own claim,
heartbeat and event source (trainer.events); their events carry ``node``. The service
decides the attempt from all of them (service.api.jobs.state).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from trainer.config import ConfigError, frozen_data_path
from trainer.events import NODE_SEQ_SHIFT, Publisher, worker_source
from trainer.fence import raise_fence
from trainer.files import FILE_MODE, UMASK, fix_tree, make_dirs, set_mode
from worker.context import Slot, WorkerContext
from worker.gang import Gang, free_port
from worker.launch import (
    build_env,
    build_guard_argv,
    build_torchrun_argv,
    omp_threads,
    owner_secrets,
    safe_job_id,
    trackers_of,
)
from worker.logs import LogForwarder
from worker.message import JobMessage
from worker.outcome import Outcome, classify, read_exit_json, stop_line
from worker.procs import kill_group, signal_group, wait_group_gone
from worker.watchers import CancelWatch, Heartbeat

__all__ = ["Unreachable", "has_checkpoint", "run_attempt", "write_run_config"]

log = logging.getLogger(__name__)

CLAIM_TTL_S = 7 * 24 * 3600
GANG_TTL_S = 24 * 3600  # a late node finds the gang closed for this long
# Redis away at claim time: a blip is waited out; longer, the task goes back to its queue.
_CLAIM_RETRY_S = 5.0
CANCELLED = "cancelled by the user"


def _label(msg: JobMessage) -> str:
    node = f" node {msg.node_rank}" if msg.nodes > 1 else ""
    return f"{msg.job_id}:{msg.attempt}{node}"


class Unreachable(Exception):
    """Redis did not answer the claim: nothing was started."""


def _claim(ctx: WorkerContext, msg: JobMessage) -> bool:
    """Take the attempt's node: True if this call holds its claim key.

    The key's value is this worker's name and a token of this call's own. A SET whose reply
    was lost (the command ran, the connection died before the answer) is tried again, by
    redis-py or by the loop below, and then finds the key taken; reading the value back
    tells our own claim from another delivery's, so a lost reply does not strand the attempt
    until the reconciler calls it lost."""
    key = ctx.keys.claim(msg.job_id, msg.attempt, msg.node_rank)
    token = f"{ctx.name} {secrets.token_hex(8)}"
    deadline = time.monotonic() + _CLAIM_RETRY_S
    while True:
        try:
            if ctx.redis.set(key, token, nx=True, ex=CLAIM_TTL_S):
                return True
            held = ctx.redis.get(key)
            return held is not None and held.decode(errors="replace") == token
        except Exception as exc:
            ctx.changed()  # the registry asks Redis now, and stops the intake if it is gone
            if time.monotonic() >= deadline:
                raise Unreachable(
                    f"worker {ctx.name} cannot reach Redis to claim {_label(msg)}: {exc}"
                ) from exc
            log.warning("claim of %s waits for Redis: %s", _label(msg), exc)
            time.sleep(1.0)


def run_attempt(msg: JobMessage, ctx: WorkerContext) -> Outcome | None:
    """Run one attempt to its end; None if another delivery already claimed it."""
    label = _label(msg)
    if not _claim(ctx, msg):
        log.warning("attempt %s is already claimed; duplicate delivery ignored", label)
        return None
    s, node = ctx.settings, msg.node_rank
    pub = Publisher(
        s.redis_url,
        msg.job_id,
        msg.attempt,
        worker_source(node),
        prefix=s.redis_prefix,
        seq_start=node << NODE_SEQ_SHIFT,
    )
    wake = threading.Event()

    def superseded() -> bool:
        """A newer attempt holds the job's fence, or the service called this one lost (its
        stop key: the next attempt may be waiting for this very slot, so it cannot claim)."""
        pipe = ctx.redis.pipeline(transaction=False)
        pipe.hget(ctx.keys.fence(msg.job_id), "attempt")
        pipe.exists(ctx.keys.stop(msg.job_id, msg.attempt))
        newest, stopped = pipe.execute()
        return bool(stopped) or (newest is not None and int(newest) > msg.attempt)

    hb = Heartbeat(
        ctx.redis,
        ctx.keys.heartbeat(msg.job_id, msg.attempt, node),
        ctx.name,
        s.heartbeat_ttl_s,
        superseded=superseded,
        on_lost=wake.set,
    )
    ctx.track(msg.job_id, msg.attempt, wake, node)
    try:
        with ctx.slot() as slot:
            try:
                outcome = _Attempt(msg, ctx, pub, slot, wake, hb).run()
            except Exception as exc:  # our own fault, not the run's: the service retries
                log.exception("attempt %s failed in the worker", label)
                outcome = Outcome(None, "lost", f"worker {ctx.name} failed: {exc}")
        data = outcome.data()
        if msg.nodes > 1:
            data["node"] = node
        pub.emit("lifecycle", data)
        sent = pub.close(s.flush_timeout_s)
        if not sent:
            log.error("attempt %s: %d events not sent (Redis unreachable)", label, pub.pending())
        if sent:
            # The exit is on the stream but maybe not yet ingested (an API under load): an
            # "exited" marker replaces the heartbeat, and the reaper waits for the ingest.
            hb.hand_over(ctx.keys.exited(msg.job_id, msg.attempt, node), s.exit_marker_ttl_s)
        else:
            hb.stop()  # the exit event is unsent: the heartbeat expires on its own, then lost
    finally:
        ctx.untrack(msg.job_id, msg.attempt, node)
    log.info("attempt %s exited: %s", label, outcome)
    return outcome


def has_checkpoint(run_dir: Path, step: int) -> bool:
    """A complete checkpoint (trainer.checkpoint's step-N/DONE) of step ``step`` or later."""
    for done in (run_dir / "checkpoints").glob("step-*/DONE"):
        n = done.parent.name.removeprefix("step-")
        if n.isdigit() and int(n) >= step:
            return True
    return False


def write_run_config(run_dir: Path, train: dict[str, Any]) -> None:
    """RUN_DIR/config.json, replaced atomically. Every node of a multi-node attempt writes it
    into the same (shared) run dir, the same content: each through a temporary file of its
    own, so one writer's rename can never take another's file from under it."""
    tmp = run_dir / f".config.json.{socket.gethostname()}.{os.getpid()}.{threading.get_ident()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    try:
        set_mode(fd)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(train, indent=2) + "\n")
        os.replace(tmp, run_dir / "config.json")
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk keeps no half-written file of ours
        raise


class _Attempt:
    def __init__(
        self,
        msg: JobMessage,
        ctx: WorkerContext,
        pub: Publisher,
        slot: Slot,
        wake: threading.Event,
        hb: Heartbeat,
    ) -> None:
        self.msg, self.ctx, self.pub, self.slot, self.wake = msg, ctx, pub, slot, wake
        self.hb = hb
        self.s = ctx.settings
        self.multi = msg.nodes > 1
        self.gang = Gang(
            ctx.redis,
            ctx.keys.gang(msg.job_id, msg.attempt),
            nodes=msg.nodes,
            node=msg.node_rank,
            member=ctx.name,
            ttl_s=GANG_TTL_S,
        )
        self.cancel = CancelWatch(
            ctx.redis,
            key=ctx.keys.cancel(msg.job_id),
            channel=ctx.keys.cancel_channel(),
            job_id=msg.job_id,
            poll_s=self.s.cancel_poll_s,
            wake=wake,
            stop_key=ctx.keys.stop(msg.job_id, msg.attempt),
            preempt_key=ctx.keys.preempt(msg.job_id, msg.attempt),
        )

    def run(self) -> Outcome:
        early = self._refuse()
        if early is not None:
            self._leave_gang(early)
            return early
        run_dir = (self.s.runs_root / self.msg.job_id).resolve()
        try:
            self._prepare(run_dir)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            # The runs root is full, and not by this job (it has not started): requeued
            # without a retry spent (no_worker's backoff), never failed or lost for it.
            early = Outcome(
                None,
                "no_worker",
                f"worker {self.ctx.name} cannot prepare the run folder: its runs root is"
                f" full ({os.strerror(exc.errno)}); requeued",
            )
            self._leave_gang(early)
            return early
        self.cancel.start()
        try:
            endpoint = None
            if self.multi:
                endpoint, early = self._gather()
                if early is not None:
                    return early
            return self._launch_and_watch(run_dir, endpoint)
        finally:
            self.cancel.stop()

    def _interrupted(self) -> Outcome | None:
        """Shutdown or cancel, seen before anything was launched."""
        ctx = self.ctx
        if ctx.preempt.is_set():
            return Outcome(None, "preempted", f"worker {ctx.name} is shutting down")
        if self.cancel.check():
            if self.cancel.stopped:
                return Outcome(None, *self._stopped())
            if self.cancel.preempted is not None:
                return Outcome(None, "preempted", f"before launch: {self.cancel.preempted}")
            return Outcome(None, "cancelled", "cancelled before launch")
        return None

    def _stopped(self) -> tuple[str, str]:
        """The reason and message of a node stopped by the service's stop key: its attempt
        ended on another node, or the service called it lost (its heartbeat expired: this
        host was cut off, and the job runs again)."""
        if self.multi:
            return "cancelled", f"stopped: attempt {self.msg.attempt} already ended on another node"
        return "superseded", (
            f"stopped: the service called attempt {self.msg.attempt} lost (its heartbeat"
            f" expired while worker {self.ctx.name} could not reach Redis) and runs the job"
            " again"
        )

    def _refuse(self) -> Outcome | None:
        """Reasons not to launch at all, found without starting a process."""
        msg, ctx = self.msg, self.ctx
        early = self._interrupted()
        if early is not None:
            return early
        if not safe_job_id(msg.job_id):
            return Outcome(None, "spec_error", f"job id {msg.job_id!r} cannot name a run folder")
        early = self._fence()
        if early is not None:
            return early
        gpus = self.slot.gpus
        if gpus is not None and msg.procs_per_node > len(gpus):
            return Outcome(
                None,
                "spec_error",
                f"procs_per_node={msg.procs_per_node} but a slot of worker "
                f"{ctx.name} has {len(gpus)} GPU(s)",
            )
        path = msg.train.data.path
        try:  # the rule of trainer.paths again, here where the files are (the trainer too)
            data = frozen_data_path(msg.train, self.s.data_root, msg.owner)
        except ConfigError as exc:
            return Outcome(None, "spec_error", str(exc))
        if not data.is_dir():
            return Outcome(
                None,
                "spec_error",
                f"data.path {path!r}: no such folder under the data root of worker {ctx.name}",
            )
        return None

    def _fence(self) -> Outcome | None:
        """Raise the job's fence to this attempt (trainer.fence); a reason not to start if a
        newer attempt holds it, or if the checkpoint the last attempt published is not in
        this worker's runs root (a root not shared between hosts: starting would silently
        train again from step 0)."""
        msg, ctx, s = self.msg, self.ctx, self.s
        try:
            newest, step = raise_fence(ctx.redis, ctx.keys.fence(msg.job_id), msg.attempt)
        except Exception as exc:  # Redis away: the ranks' own check still guards
            log.warning("fence of %s not raised: %s", _label(msg), exc)
            return None
        if newest > msg.attempt:
            return Outcome(
                None, "superseded", f"attempt {msg.attempt} superseded by attempt {newest}"
            )
        if step and not has_checkpoint(s.runs_root / msg.job_id, step):
            return Outcome(
                None,
                "lost",
                f"worker {ctx.name} cannot see checkpoint step {step} of this job (published by"
                f" an earlier attempt) under its runs root {s.runs_root}: the runs root must be"
                " one folder shared by every worker host; not started, so as not to train again"
                " from step 0",
            )
        return None

    def _leave_gang(self, outcome: Outcome) -> None:
        """A node that will not launch closes its gang, so the others give up at once."""
        if not self.multi:
            return
        try:
            self.gang.close(
                f"node {self.msg.node_rank} on worker {self.ctx.name} did not start: "
                f"{outcome.reason}: {outcome.message}"
            )
        except Exception as exc:  # the others time out instead
            log.warning("could not close the gang of %s: %s", _label(self.msg), exc)

    def _gather(self) -> tuple[str | None, Outcome | None]:
        """Join the gang and wait for all of it: (rendezvous endpoint, None), or (None, why
        this node gives up without launching)."""
        msg, ctx, s = self.msg, self.ctx, self.s
        endpoint = None
        if msg.node_rank == 0:
            endpoint = f"{ctx.advertised.host}:{free_port()}"
        if self.gang.join(endpoint):
            log.info("attempt %s joined its gang of %d", _label(msg), msg.nodes)
            state = self.gang.wait(
                s.gang_timeout_s,
                wake=self.wake,
                interrupted=lambda: ctx.preempt.is_set() or self.cancel.requested.is_set(),
            )
        else:
            state = self.gang.state()
        if state.complete:
            return state.endpoint, None
        if state.closed is not None:
            return None, Outcome(None, "no_worker", state.closed)
        early = self._interrupted() or Outcome(None, "cancelled", "cancelled before launch")
        self._leave_gang(early)
        return None, early

    def _prepare(self, run_dir: Path) -> None:
        make_dirs(run_dir / "logs")
        # A retry shares the run dir: an old attempt's failure must not classify this one.
        (run_dir / "exit.json").unlink(missing_ok=True)
        write_run_config(run_dir, self.msg.train.model_dump(mode="json"))

    def _launch_and_watch(self, run_dir: Path, endpoint: str | None) -> Outcome:
        s, msg, ctx = self.s, self.msg, self.ctx
        python = s.python or sys.executable
        torchrun = build_torchrun_argv(
            python,
            nnodes=msg.nodes,
            node_rank=msg.node_rank,
            rdzv_endpoint=endpoint,
            rdzv_id=f"{msg.job_id}-{msg.attempt}" if endpoint else None,
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
            redis_url=s.rank_redis_url or s.redis_url,
            redis_prefix=s.redis_prefix,
            job_id=msg.job_id,
            attempt=msg.attempt,
            threads=omp_threads(len(os.sched_getaffinity(0)), ctx.slot_count, msg.procs_per_node),
            ifname=ctx.advertised.ifname if self.multi else None,
            trackers=trackers_of(msg.train),
            tracking_allow_private=s.tracking_allow_private,
            secrets=owner_secrets(s.tracking_secrets, msg.owner, trackers_of(msg.train)),
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
            umask=UMASK,  # what torchrun and the ranks write (trainer.files)
        )
        pgid = proc.pid  # the guard leads the new session and its process group
        running: dict[str, object] = {
            "phase": "running",
            "host": ctx.host,
            "worker": ctx.name,
            "pid": proc.pid,
        }
        if self.multi:
            running["node"] = msg.node_rank
        self.pub.emit("lifecycle", running)
        logs = LogForwarder(
            self.pub,
            batch_lines=s.log_batch_lines,
            batch_s=s.log_batch_s,
            tail_lines=s.log_tail_lines,
            node=msg.node_rank if self.multi else None,
            max_lines=s.log_max_lines,
            keep_last=s.log_keep_last,
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
        stop_reason, stop_message, stop_signal = None, "", None
        try:
            stop_reason, stop_message = self._watch(exited)
            if stop_reason is not None:
                stop_signal = self._stop_group(pgid, exited)
        finally:
            # Whatever happened above, nothing of the run outlives the attempt.
            if not exited.is_set():
                signal_group(pgid, signal.SIGKILL)
                exited.wait(10)
            if not kill_group(pgid):
                log.error("process group %d of %s survived SIGKILL", pgid, msg.job_id)
            code = proc.wait()
            proc.stdin.close()
            exit_info = read_exit_json(run_dir)
            last_line = None
            if stop_reason is not None:
                if stop_reason == "preempted" and self.cancel.cancelled():
                    # The user cancelled while it stopped for another reason: a cancel.
                    log.info("attempt %s was cancelled while it yielded", _label(msg))
                    stop_reason, stop_message = "cancelled", CANCELLED
                last_line = stop_line(stop_message, stop_signal, exit_info, s.cancel_grace_s)
            logs.close(last_line=last_line)
        try:  # torchrun makes its log folders with mkdtemp (0700); the run is over now
            fix_tree(run_dir / "logs")
        except OSError as exc:
            log.warning("could not set the modes of %s: %s", run_dir / "logs", exc)
        return classify(
            code,
            stop_reason=stop_reason,
            stop_message=stop_message,
            stop_signal=stop_signal,
            exit_info=exit_info,
            agent_lines=logs.agent,
            tail=logs.last_lines(),
        )

    def _watch(self, exited: threading.Event) -> tuple[str | None, str]:
        msg, ctx = self.msg, self.ctx
        limit = msg.max_runtime_s
        deadline = time.monotonic() + limit if limit else None
        while not exited.is_set():
            # Everything that ends the watch sets ``wake`` (the exit, a cancel, a shutdown),
            # so it sleeps until then or the deadline: no polling next to the ranks.
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            self.wake.wait(timeout)
            self.wake.clear()
            if exited.is_set():
                break
            if self.hb.lost.is_set():
                return "superseded", (
                    f"worker {ctx.name} could not reach Redis for {self.hb.outage_s:.0f} s:"
                    " its heartbeat expired, so the service counts this attempt lost and runs"
                    " the job again (on any worker); this node of the attempt was stopped"
                )
            if ctx.preempt.is_set():
                return "preempted", (
                    f"worker {ctx.name} shut down; the run was stopped "
                    f"to resume from its checkpoint elsewhere"
                )
            if self.cancel.requested.is_set():
                if self.cancel.stopped:
                    return self._stopped()
                if self.cancel.preempted is not None:
                    return "preempted", self.cancel.preempted
                return "cancelled", CANCELLED
            if deadline is not None and time.monotonic() >= deadline:
                return "timeout", f"ran past max_runtime_s={limit}"
        return None, ""

    def _stop_group(self, pgid: int, exited: threading.Event) -> signal.Signals | None:
        """SIGTERM to every process of the run (ranks checkpoint), then SIGKILL after grace.
        The last signal sent, or None if the run had ended before any was."""
        grace = self.s.cancel_grace_s
        deadline = time.monotonic() + grace
        if not signal_group(pgid, signal.SIGTERM):
            return None
        # torchrun may exit before its ranks finish their checkpoint: wait for the group.
        exited.wait(grace)
        if not wait_group_gone(pgid, max(0.0, deadline - time.monotonic())):
            log.warning(
                "run %s still running %.0f s after SIGTERM; killing it", self.msg.job_id, grace
            )
            signal_group(pgid, signal.SIGKILL)
            return signal.SIGKILL
        return signal.SIGTERM
