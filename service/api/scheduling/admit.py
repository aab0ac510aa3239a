"""The admitter: the service decides which queued job starts where; Celery only carries.

Jobs wait in SQL as ``queued``; their current attempt is ``dispatched`` with
``attempts.placement`` null. One pass at a time across all API replicas (the reconciler's
lock pattern), woken by events (a submit, an attempt's exit, a worker joining or leaving, a
cancel; all publish on ``Keys.admit_channel``) and by a slow periodic pass:

1. Capacity: the live workers of the registry (``{prefix}:workers``; an entry older than
   ``worker_stale_s`` or draining offers nothing), each with ``slots`` of ``slot_procs``
   ranks; minus what is placed on it and not yet seen to end (attempts ``dispatched`` or
   ``running`` with a placement: the admitter's own record), or what the worker says it
   holds, whichever is more. A worker that vanishes returns its capacity when its entry goes
   stale; an attempt placed on it that no node claimed is placed again elsewhere.
2. Order, per queue: priority (higher first; a waiting attempt gains +1 per
   ``priority_aging_s`` it has waited, at most ``priority_aging_max``, so a stream of
   urgent jobs cannot keep a normal one out for ever; aging orders, it never preempts),
   then fair share between owners (slot-seconds used, halved every
   ``fair_share_half_life_s``, kept in Redis so a replica that takes over the lock
   continues it; a placement charges its owner at once, so two owners with equal use
   alternate within a pass), then submit time (the job id is time-ordered). A retry or
   a preempted job keeps its job's place.
3. Placement, all nodes at once or none (a gang never holds half the cluster): each node on
   a slot of a worker that serves the queue and whose slot holds ``procs_per_node`` ranks,
   fullest workers first (best fit). A job that does not fit is skipped and later ones may
   still start (Kueue's BestEffortFIFO); a job over its owner's running quota waits.
4. Preemption: for the first job of a queue that waits for capacity (only that one: a job
   behind it never preempts while it waits), if strictly
   lower-priority running jobs of that queue hold enough, the fewest and newest of them are
   asked to yield (``Keys.preempt``: the worker stops the run with SIGTERM, the trainer
   checkpoints, the attempt exits ``preempted``, and the state machine requeues the job
   without spending a retry). A job is preempted at most once per
   ``preempt_min_interval_s``, and a job that has yielded ``preempt_max_per_job`` times
   is not asked again (it runs to its end); while a preemption in a queue is under way,
   none more starts there.
5. Commit the placements (compare-and-set on the attempt), then send each node's message to
   its worker's own queue (``worker.message.worker_queue``) and mark the attempt sent. A
   send that fails leaves ``sent_at`` null: the next pass sends it again to the same workers
   (or places it again if one of them died); only the admitter sends in this mode, so the
   reconciler and the admitter never both send one attempt (and the worker's claim makes a
   duplicate harmless anyway).
6. Pending reasons: every queued job's position in its queue's admission order, what it
   waits for and who is ahead, written to Redis (``{prefix}:pending``) for the first
   ``PENDING_DETAIL`` jobs of each queue, and a summary for the rest.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections import defaultdict, deque
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import and_, func, null, select, update
from sqlalchemy.orm import Session, sessionmaker

from service.api.core.models import ATTEMPTS, JOBS
from service.api.core.settings import Settings
from service.api.scheduling.decide import (
    Held,
    Pending,
    Plan,
    Waiting,
    capacity,
    decide,
    live_entries,
    units,
)
from service.api.scheduling.dispatch import Dispatcher, dispatch_attempts
from service.api.scheduling.limits import running_caps
from service.api.scheduling.passlock import StorePass, one_pass
from service.api.scheduling.pending import gone_key
from worker.message import message_tag, worker_queue

__all__ = ["Admitter"]

log = logging.getLogger(__name__)

# The waiting attempts are read whole at least this often (else only the new ones).
WAITING_REFRESH_S = 30.0
# New attempts are looked for from the highest id seen this long ago (see Admitter._waiting).
MARK_LAG_S = 5.0


# The waiting attempts: queued jobs whose current attempt is not placed yet, in id order.
_WAITING = (
    select(
        JOBS.c.id.label("job_id"),
        JOBS.c.attempt,
        JOBS.c.owner,
        JOBS.c.queue,
        JOBS.c.nodes,
        JOBS.c.procs_per_node.label("procs"),
        JOBS.c.priority,
        JOBS.c.not_before,
        ATTEMPTS.c.created_at.label("since"),
    )
    .join(ATTEMPTS, and_(ATTEMPTS.c.job_id == JOBS.c.id, ATTEMPTS.c.number == JOBS.c.attempt))
    .where(
        JOBS.c.status == "queued",
        ATTEMPTS.c.status == "dispatched",
        ATTEMPTS.c.placement.is_(None),
    )
    .order_by(JOBS.c.id)
)

# A job's earlier attempts, counted for its preemption budget (Held.preemptions).
_YIELDED = ATTEMPTS.alias("yielded")

# -- The pass against the stores -------------------------------------------------------------


class Admitter(StorePass):
    lock_name = "admit"

    def __init__(
        self,
        settings: Settings,
        sessions: sessionmaker[Session],
        redis: Any,
        dispatcher: Dispatcher,
    ) -> None:
        super().__init__(settings, sessions, redis, dispatcher)
        prefix = settings.redis_prefix
        self.usage_key = f"{prefix}:usage"
        self.pending_key = f"{prefix}:pending"
        self.pending_queues_key = f"{prefix}:pending:queues"
        self.wake_event = dispatcher.admit_wake  # set by this process's submits and events
        self.gen_key = f"{prefix}:admit:gen"
        self.gone_key = gone_key(prefix)
        # The waiting attempts as of the last pass (``_waiting``), and what it was read at.
        self._cache: dict[str, Waiting] | None = None
        self._gen = -1
        self._refreshed_at = 0.0
        self._marks: deque[tuple[float, int]] = deque()  # (time, highest attempt id then)
        self._last_pending: dict[str, str] = {}
        self.last: dict[str, float] = {}  # timings of the last pass (ms), for the benchmark

    # The stores' view -----------------------------------------------------------------------

    def _held(self, session: Session) -> list[Any]:
        return list(
            session.execute(
                select(
                    ATTEMPTS.c.id,
                    ATTEMPTS.c.job_id,
                    ATTEMPTS.c.number,
                    ATTEMPTS.c.status,
                    ATTEMPTS.c.placement,
                    ATTEMPTS.c.sent_at,
                    ATTEMPTS.c.created_at,
                    JOBS.c.owner,
                    JOBS.c.queue,
                    JOBS.c.nodes,
                    JOBS.c.procs_per_node,
                    JOBS.c.priority,
                    JOBS.c.preempted_at,
                    select(func.count())
                    .select_from(_YIELDED)
                    .where(_YIELDED.c.job_id == JOBS.c.id, _YIELDED.c.reason == "preempted")
                    .scalar_subquery()
                    .label("preemptions"),
                )
                .join(JOBS, JOBS.c.id == ATTEMPTS.c.job_id)
                .where(
                    ATTEMPTS.c.status.in_(("dispatched", "running")),
                    ATTEMPTS.c.placement.is_not(None),
                )
            )
        )

    def _waiting(self, session: Session, now: float) -> list[Waiting]:
        """The waiting attempts, in id order, read whole or only what is new.

        A long queue is 10,000 rows, most of a pass's time, and between two passes of one
        replica little of it changes. What makes an attempt wait is always a new attempt row
        (a submit, a retry, a requeue), so the attempts past the last id seen are the new
        ones; what stops one waiting is a placement (this pass's own), a cancel (the cancel
        route adds the job to ``{prefix}:admit:gone``), or another replica's placements
        (each pass that places bumps ``{prefix}:admit:gen``; a replica that finds it moved
        by someone else reads everything again). A full read also comes every
        ``WAITING_REFRESH_S`` whatever happened, so a missed notice costs only a stale
        position for that long; a stale entry is never placed, since placing is a
        compare-and-set on the attempt."""
        gen, gone = self._notices()
        cache = self._cache
        full = cache is None or gen != self._gen or now - self._refreshed_at >= WAITING_REFRESH_S
        top = session.execute(select(func.coalesce(func.max(ATTEMPTS.c.id), 0))).scalar()
        if full:
            cache = {w.job_id: w for w in self._read(session, _WAITING)}
            self._refreshed_at = now
            self._marks.clear()
        else:
            assert cache is not None
            for job_id in gone:
                cache.pop(job_id, None)
            # From the highest id seen MARK_LAG_S ago: an attempt row's id is taken at its
            # insert, and a transaction may commit a lower id after a higher one.
            since = next((m for t, m in reversed(self._marks) if t <= now - MARK_LAG_S), None)
            since = self._marks[0][1] if since is None else since
            for w in self._read(session, _WAITING.where(ATTEMPTS.c.id > since)):
                cache[w.job_id] = w
        self._marks.append((now, int(top or 0)))
        while len(self._marks) > 1 and self._marks[1][0] <= now - MARK_LAG_S:
            self._marks.popleft()
        self._cache, self._gen = cache, gen
        return list(cache.values())

    def _read(self, session: Session, stmt: Any) -> list[Waiting]:
        """Rows of ``stmt`` as ``Waiting``. On PostgreSQL through the driver's own tuples:
        10,000 rows cost a third as much without SQLAlchemy's rows."""
        conn = session.connection()
        if conn.dialect.name == "postgresql":
            sql = str(stmt.compile(dialect=conn.dialect, compile_kwargs={"literal_binds": True}))
            driver = conn.connection.driver_connection
            assert driver is not None
            return list(map(Waiting._make, driver.execute(sql).fetchall()))
        return list(map(Waiting._make, session.execute(stmt)))

    def _notices(self) -> tuple[int, list[str]]:
        """The placement generation, and the jobs cancelled since the last pass (taken)."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.get(self.gen_key)
        pipe.smembers(self.gone_key)
        pipe.delete(self.gone_key)
        gen, gone, _ = pipe.execute()
        names = [g.decode() if isinstance(g, bytes) else str(g) for g in gone or ()]
        return int(gen or 0), names

    def _placed(self, jobs: Iterable[str]) -> None:
        """These jobs wait no more; other replicas learn it by the generation moving."""
        cache = self._cache
        if cache is not None:
            for job_id in jobs:
                cache.pop(job_id, None)
        gen = int(self.redis.incr(self.gen_key))
        if gen != self._gen + 1:
            self._cache = None  # another replica placed since this pass read: read it all
        self._gen = gen

    def _usage(self, held: list[Held], gpu: Mapping[str, bool], now: float) -> dict[str, float]:
        """Each owner's decayed slot-seconds; the owners holding slots now are charged the
        time since their last update (at most a few intervals: a replica taking over the
        lock does not charge for the time nobody was admitting)."""
        half = self.settings.fair_share_half_life_s
        raw = self.redis.hgetall(self.usage_key)
        usage: dict[str, float] = {}
        stamps: dict[str, float] = {}
        for k, v in raw.items():
            try:
                value, ts = (float(x) for x in v.decode().split(":"))
            except (ValueError, AttributeError):
                continue
            owner = k.decode() if isinstance(k, bytes) else str(k)
            usage[owner] = value * math.pow(2.0, -max(0.0, now - ts) / half)
            stamps[owner] = ts
        holding: dict[str, int] = defaultdict(int)
        for h in held:
            holding[h.owner] += units(h.nodes, h.procs, gpu.get(h.queue, False))
        if holding:
            most = self.settings.admit_interval_s * 5
            pipe = self.redis.pipeline(transaction=False)
            for owner, n in holding.items():
                dt = min(most, max(0.0, now - stamps.get(owner, now)))
                usage[owner] = usage.get(owner, 0.0) + n * dt
                pipe.hset(self.usage_key, owner, f"{usage[owner]:.3f}:{now:.3f}")
            pipe.execute()
        return usage

    # One pass -------------------------------------------------------------------------------

    def run_once(self) -> dict[str, int] | None:
        """One pass if no other replica holds the lock: counts of what it did, else None."""
        ttl_s = max(10.0, self.settings.admit_interval_s * 10)
        with one_pass(self.redis, self.lock_key, ttl_s) as mine:
            return self._pass() if mine else None

    def _pass(self) -> dict[str, int]:
        t0 = time.perf_counter()
        now_s = time.time()
        now = datetime.fromtimestamp(now_s, UTC)
        raw = self.redis.hgetall(self.keys.workers)
        entries = live_entries(raw, now_s, self.settings.worker_stale_s)
        with self.sessions() as session:
            held_rows = self._held(session)
            waiting = self._waiting(session, now_s)
            default_cap, caps = running_caps(session, self.settings)
        t_read = time.perf_counter()
        live = {e["name"]: e for e in entries}
        accepting = {n: e for n, e in live.items() if not e.get("draining")}
        # Placed attempts on workers that are gone, which no node has claimed: place again.
        held_rows, unplaced = self._release_dead(held_rows, live)
        resend = [r for r in held_rows if r.sent_at is None and r.status == "dispatched"]
        held = [
            Held(r.job_id, r.number, r.owner, r.queue, r.nodes, r.procs_per_node, r.priority,
                 list(r.placement), r.created_at, r.preempted_at, r.status, r.preemptions)
            for r in held_rows
        ]  # fmt: skip
        placed_on: dict[str, int] = defaultdict(int)
        for h in held:
            for name in h.placement:
                placed_on[name] += 1
        workers = [
            w
            for name, e in accepting.items()
            if (w := capacity(name, e, placed_on.get(name, 0))) is not None
        ]
        gpu = {q: bool(w.gpus_per_slot) for w in workers for q in w.queues}
        usage = self._usage(held, gpu, now_s)
        t_prep = time.perf_counter()
        plan = decide(
            workers,
            waiting,
            held,
            usage,
            now=now,
            default_cap=default_cap,
            caps=caps,
            preempt_interval_s=self.settings.preempt_min_interval_s,
            preemption=self.settings.preemption,
            aging_s=self.settings.priority_aging_s,
            aging_max=self.settings.priority_aging_max,
            preempt_budget=self.settings.preempt_max_per_job,
        )
        t_decide = time.perf_counter()
        placed = self._commit(plan.place)
        if plan.place:  # placed, or found placed or cancelled by someone else: not waiting
            self._placed(job for job, _ in plan.place)
        # Placed and resent attempts go to their workers' queues (dispatch_attempts sends
        # by the placement, and marks what went out).
        sent = dispatch_attempts(
            self.sessions, self.dispatcher, placed + [(r.job_id, r.number) for r in resend]
        )
        preempted = self._preempt(plan.preempt, now)
        # A placed job stays queued until its worker reports it running: it says where.
        starting = {(h.job_id, h.attempt): h.placement for h in held if h.status == "dispatched"}
        starting.update({key: plan.place[key] for key in placed})
        self._write_pending(plan, starting)
        t_end = time.perf_counter()
        self.last = {
            "read_ms": (t_read - t0) * 1000,
            "prepare_ms": (t_prep - t_read) * 1000,
            "decide_ms": (t_decide - t_prep) * 1000,
            "act_ms": (t_end - t_decide) * 1000,
            "total_ms": (t_end - t0) * 1000,
        }
        return {
            "placed": len(placed),
            "sent": sent,
            "preempted": preempted,
            "unplaced": unplaced,
            "waiting": len(waiting),
        }

    def _release_dead(self, rows: list[Any], live: Mapping[str, Any]) -> tuple[list[Any], int]:
        """Attempts placed on a worker that left the registry and that no node claimed go
        back to waiting (their message is taken out of the dead worker's queue); the others
        stay held. A claimed one is the heartbeat reaper's (it becomes lost, then a retry)."""
        suspects = [
            r for r in rows if r.status == "dispatched" and any(n not in live for n in r.placement)
        ]
        if not suspects:
            return rows, 0
        pipe = self.redis.pipeline(transaction=False)
        for r in suspects:
            for n in range(r.nodes):
                pipe.exists(self.keys.claim(r.job_id, r.number, n))
        answers = iter(pipe.execute())
        release = []
        for r in suspects:
            claims = [bool(next(answers)) for _ in range(r.nodes)]
            if not any(claims):
                release.append(r)
        if not release:
            return rows, 0
        with self.sessions() as session, session.begin():
            for r in release:
                session.execute(
                    update(ATTEMPTS)
                    .where(ATTEMPTS.c.id == r.id, ATTEMPTS.c.status == "dispatched")
                    .values(placement=null(), sent_at=None)  # SQL NULL, not JSON null
                )
        for r in release:
            log.warning(
                "job %s attempt %d: placed on %s, which left before claiming it; placing it again",
                r.job_id,
                r.number,
                ", ".join(sorted(set(r.placement) - set(live))),
            )
            self._withdraw(r)
        gone = {r.id for r in release}
        self._cache = None  # they wait again: the next pass reads the whole queue
        return [r for r in rows if r.id not in gone], len(release)

    def _withdraw(self, row: Any) -> None:
        """Take an attempt's messages out of the queues of workers that are gone."""
        broker = self.dispatcher.broker_client()
        for node, name in enumerate(row.placement):
            tag = message_tag(row.job_id, row.number, node).encode()
            queue = worker_queue(name, self.settings.redis_prefix)
            try:
                for raw in broker.lrange(queue, 0, 999):
                    if tag in raw:
                        broker.lrem(queue, 1, raw)
            except Exception as exc:  # the claim makes a leftover harmless
                log.warning("could not withdraw %s from %s: %s", tag, queue, exc)

    def _commit(self, place: Mapping[tuple[str, int], list[str]]) -> list[tuple[str, int]]:
        """Record the placements (compare-and-set: still waiting, job still queued)."""
        if not place:
            return []
        done = []
        with self.sessions() as session, session.begin():
            for (job_id, number), chosen in place.items():
                result = session.execute(
                    update(ATTEMPTS)
                    .where(
                        ATTEMPTS.c.job_id == job_id,
                        ATTEMPTS.c.number == number,
                        ATTEMPTS.c.status == "dispatched",
                        ATTEMPTS.c.placement.is_(None),
                    )
                    .values(placement=chosen, sent_at=None)
                )
                if result.rowcount:  # type: ignore[attr-defined]
                    done.append((job_id, number))
        return done

    def _preempt(self, victims: list[tuple[Held, str]], now: datetime) -> int:
        if not victims:
            return 0
        with self.sessions() as session, session.begin():
            for h, _ in victims:
                session.execute(update(JOBS).where(JOBS.c.id == h.job_id).values(preempted_at=now))
        pipe = self.redis.pipeline(transaction=False)
        for h, msg in victims:
            log.info("preempting job %s attempt %d: %s", h.job_id, h.attempt, msg)
            pipe.set(self.keys.preempt(h.job_id, h.attempt), msg, ex=7 * 24 * 3600)
        pipe.publish(self.keys.cancel_channel(), "preempt")  # wakes the workers' watches
        pipe.execute()
        return len(victims)

    def _write_pending(self, plan: Plan, starting: Mapping[tuple[str, int], list[str]]) -> None:
        """The pending reasons, replaced whole when they changed (one MULTI)."""
        reasons = {job: why.dumps() for lst in plan.reasons.values() for job, why in lst}
        for (job, attempt), workers in starting.items():
            on = ", ".join(f"node {n} on {w}" for n, w in enumerate(workers))
            why = f"admitted: attempt {attempt} placed ({on}); waiting for it to start"
            reasons[job] = Pending(why).dumps()
        summary = {q: json.dumps(s) for q, s in plan.summary.items()}
        digest = json.dumps([sorted(reasons.items()), sorted(summary.items())])
        if self._last_pending.get("digest") == digest:
            return
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(self.pending_key, self.pending_queues_key)
        if reasons:
            pipe.hset(self.pending_key, mapping=reasons)
        if summary:
            pipe.hset(self.pending_queues_key, mapping=summary)
        pipe.execute()
        self._last_pending["digest"] = digest

    # The loop -------------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Passes until ``stop``: at each wake-up (this process's event, or the admit
        channel), and every ``admit_interval_s``."""
        listener = threading.Thread(target=self._listen, args=(stop,), daemon=True)
        listener.start()
        while not stop.is_set():
            self.wake_event.clear()
            try:
                done = self.run_once()
                if done is None:  # another replica holds the lock: try again soon
                    stop.wait(0.05)
                    continue
            except Exception as exc:  # an outage: the next pass tries again
                log.warning("admit: %s", exc)
            self.wake_event.wait(self.settings.admit_interval_s)

    def _listen(self, stop: threading.Event) -> None:
        while not stop.is_set():
            pubsub = None
            try:
                pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(self.keys.admit_channel)
                while not stop.is_set():
                    if pubsub.get_message(timeout=1.0) is not None:
                        self.wake_event.set()
            except Exception as exc:
                log.debug("admit channel lost (%s)", exc)
                stop.wait(1.0)
            finally:
                if pubsub is not None:
                    try:
                        pubsub.close()
                    except Exception:
                        pass
