"""The sweeper: the periodic pass that runs every sweep, one pass at a time across API
replicas (the reconciler's lock, ``service.api.scheduling.passlock``).

Per running sweep, in one transaction with the sweep's row locked:

1. tell Optuna how each trial that ended did (its metric's last value; failed or cancelled
   trials as failed, stopped ones as pruned);
2. with early stopping, report each running trial's new metric points to its Optuna trial
   and ask the pruner; a trial it prunes is stopped as a cancel is (``stop_early``: the
   worker's SIGTERM, a checkpoint, the job ends ``stopped_early``, no retry spent);
3. propose trials up to the parallelism and the budget: ask Optuna, insert the trial's job
   (an ordinary queued job with ``sweep`` and ``params``; the Idempotency-Key
   ``sweep:{id}:{n}`` makes a second trial n impossible). A trial is a submit of the sweep's
   owner and meets the owner's limits as one does: past ``max_queued`` or
   ``submits_per_minute`` (``service.api.scheduling.ratelimit``) no trial is asked for, and a
   trial whose run would pass the owner's room for runs (``TRAINQ_RUNS_MAX_OWNER_BYTES``,
   ``service.api.jobs.room``, checked under the owner's lock like a submit) is taken back
   (the study as it was before the ask, so the same trial is proposed again later). Either
   way the trial waits for a later pass, and the sweep's ``message`` says why until then;
   nothing is spent of the budget. The pass first asks for and vets every trial it may
   make, then counts and inserts them: the owner's lock, held to the commit (so that the
   next count of that owner, a submit's say, sees the rows this one allowed), is not held
   while later trials are asked for and checked (store reads, DNS, Optuna). It cannot be
   narrowed to each trial's count-and-insert: that would need a commit per trial, and the
   pass's trials, study and count are one commit (below);
4. store the study and the count of proposals (compare-and-set on the old count), and end
   the sweep (``finish_sweep``) once its budget is spent and no trial is left.

Only after the commit are the new jobs sent (or the admitter woken), the stopped trials
signalled (again on every pass while they stop) and their status changes published: a pass
that dies anywhere before leaves nothing proposed, and a trial proposed is in the store.
"""

from __future__ import annotations

import logging
import threading
from contextlib import nullcontext
from typing import Any

from sqlalchemy import Engine, select, update
from sqlalchemy.orm import Session

from service.api.core.auth import owner_principal
from service.api.core.errors import (
    InvalidInput,
    TooManyRequests,
    TrainqError,
    first_complaint,
)
from service.api.core.models import JOBS, METRICS, SWEEPS, TERMINAL, utcnow
from service.api.events.record import record_event
from service.api.jobs import crud, room
from service.api.jobs.state import STOPPED_EARLY, Outcome, stop_early
from service.api.jobs.vet import spec_from_payload, vet_spec
from service.api.scheduling.dispatch import dispatch_attempts
from service.api.scheduling.passlock import StorePass, one_pass
from service.api.scheduling.ratelimit import SubmitLimits
from service.api.streams.notify import publish_status, signal_cancel
from service.api.sweeps import search, space

__all__ = ["Sweeper", "finish_sweep", "trial_number"]

log = logging.getLogger(__name__)


def trial_number(idempotency_key: str | None) -> int | None:
    """The trial number a sweep's job carries in its Idempotency-Key, ``sweep:{id}:{n}``."""
    if not idempotency_key or not idempotency_key.startswith("sweep:"):
        return None
    tail = idempotency_key.rsplit(":", 1)[-1]
    return int(tail) if tail.isdigit() else None


def finish_sweep(session: Session, sweep_id: str, status: str, message: str) -> bool:
    """The sweep's one end transition (running -> finished | cancelled), compare-and-set, in
    the caller's transaction; True if this call ended it. Whatever must happen once when a
    sweep ends (a ``sweep.finished`` event for its owner, say) goes here, beside the update."""
    owner = session.execute(
        update(SWEEPS)
        .where(SWEEPS.c.id == sweep_id, SWEEPS.c.status == "running")
        .values(status=status, message=message, ended_at=utcnow())
        .returning(SWEEPS.c.owner)
    ).scalar()
    if owner is None:
        return False  # ended before (a replica's pass, a cancel): nothing happens twice
    log.info("sweep %s of %s %s: %s", sweep_id, owner, status, message)
    record_event(
        session,
        owner=owner,
        type=f"sweep.{status}",
        data={"sweep_id": sweep_id, "status": status, "message": message},
    )
    return True


def limit_of(row: Any) -> int:
    """The trials a sweep makes at most: its budget, and a grid's size."""
    if row.method == "grid":
        return min(row.budget, space.grid_size(row.space))
    return int(row.budget)


class _Pass:
    """What one sweep's step did, for the work after its commit."""

    def __init__(self) -> None:
        self.outcome = Outcome()
        self.new_jobs: list[str] = []
        self.stopping: list[str] = []


class Sweeper(StorePass):
    lock_name = "sweeps"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = SubmitLimits(self.settings, self.redis, self.settings.redis_prefix)

    def run_once(self) -> int | None:
        """One pass over the running sweeps, if no other replica holds the lock; the number
        of trials proposed, else None."""
        ttl_s = max(30.0, self.settings.sweep_interval_s * 5)
        with one_pass(self.redis, self.lock_key, ttl_s) as mine:
            if not mine:
                return None
            with self.sessions() as session:
                running = select(SWEEPS.c.id).where(SWEEPS.c.status == "running")
                ids = list(session.execute(running.order_by(SWEEPS.c.id)).scalars())
            made = 0
            for sweep_id in ids:
                try:
                    made += self.step(sweep_id)
                except Exception as exc:  # one sweep's trouble must not stop the others
                    log.warning("sweep %s: %s", sweep_id, exc)
            return made

    def step(self, sweep_id: str) -> int:
        done = _Pass()
        with self.sessions() as session, session.begin():
            row = session.execute(
                select(SWEEPS).where(SWEEPS.c.id == sweep_id).with_for_update()
            ).first()
            if row is None or row.status != "running":
                return 0
            self._step(session, row, done)
        publish_status(
            self.redis, self.keys, done.outcome.changes, maxlen=self.settings.job_stream_maxlen
        )
        for job_id in done.stopping:
            signal_cancel(self.redis, self.keys, job_id)
        if done.new_jobs:
            if self.dispatcher.admits:
                self.dispatcher.wake()
            else:
                dispatch_attempts(self.sessions, self.dispatcher, [(j, 1) for j in done.new_jobs])
        return len(done.new_jobs)

    def _step(self, session: Session, row: Any, done: _Pass) -> None:
        import optuna

        study = (
            search.load(row.study)
            if row.study is not None
            else search.new_study(row.method, row.goal, row.seed, row.early_stop)
        )
        jobs = list(
            session.execute(
                select(
                    JOBS.c.id, JOBS.c.status, JOBS.c.reason, JOBS.c.idempotency_key,
                    JOBS.c.last_metrics,
                ).where(JOBS.c.sweep == row.id)
            )
        )  # fmt: skip
        trials = {t.number: t for t in study.get_trials(deepcopy=False)}
        running = optuna.trial.TrialState.RUNNING
        mine: list[tuple[Any, Any]] = []  # (Optuna trial, job) of the trials not yet told
        for job in jobs:
            number = trial_number(job.idempotency_key)
            trial = trials.get(number) if number is not None else None
            if trial is None:
                continue
            if job.status == "cancelling" and job.reason == STOPPED_EARLY:
                done.stopping.append(job.id)  # the flag again, in case the last one was lost
            if trial.state == running:
                mine.append((trial, job))
        if row.early_stop is not None:
            # A trial that ended since the last pass is reported too: the pruner compares the
            # next trials with every trial's values at its rungs, however short it ran.
            seen = [(t, j) for t, j in mine if j.status == "running" or j.status in TERMINAL]
            self._prune(session, study, row.metric, seen, done)
        for trial, job in mine:
            if job.status in TERMINAL and study.trials[trial.number].state == running:
                self._tell(study, trial, job, row.metric)
        active = sum(1 for job in jobs if job.status not in TERMINAL)
        proposed = row.proposed
        limit = limit_of(row)
        dists = space.distributions(row.space)
        owner = owner_principal(session, row.owner, self.settings.auth_enabled)
        reader, data_root = session.get_bind(), self.settings.data_root
        assert isinstance(reader, Engine)  # reads of its own, beside this transaction
        own = self.limits.owners.get(self.sessions, row.owner)
        room_limit = self.settings.runs_max_owner_bytes
        waiting: str | None = None  # why the next trial waits, if it does
        refused: str | None = None  # the last trial of this pass its values made refused
        urls = any(path.startswith("train.tracking") for path in row.space)
        try:  # the base alone, now: what no trial's values change (an init job deleted, say)
            base = spec_from_payload(space.apply(row.base, {}), data_root)
            vet_spec(self.settings, reader, owner, base, own)
        except TrainqError as exc:
            waiting = f"the next trial waits: {first_complaint(exc)}"
        # First every trial's values are asked for and checked, then the trials are counted
        # against the owner's room and limits and inserted: the owner's lock (taken by the
        # first room check, held to the commit as the count's insert must be) is then not
        # held while later trials are asked for and vetted (reads, the resolver, Optuna).
        vetted: list[tuple[bytes, int, str | None, Any, Any, int]] = []
        failed = 0  # trials refused this pass: at most the parallelism, then the next pass
        while waiting is None and active + len(vetted) < row.parallelism and proposed < limit:
            if failed >= row.parallelism:
                break
            before = search.dump(study)
            if row.method == "grid":
                study.enqueue_trial(space.grid(row.space, proposed))
            trial = study.ask(dists)
            proposed += 1
            try:  # every check of a submit, for the owner, now (service.api.jobs.vet)
                spec = spec_from_payload(space.apply(row.base, trial.params), data_root)
                spec, disk = vet_spec(self.settings, reader, owner, spec, own, check_urls=urls)
            except TrainqError as exc:  # its values: allowed by the space, not by the spec
                refused = f"trial {trial.number} was not run: {first_complaint(exc)}"
                log.info("sweep %s %s", row.id, refused)
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
                failed += 1
                continue
            vetted.append((before, proposed - 1, refused, trial, spec, disk))
        for before, asked_before, refused_before, trial, spec, disk in vetted:
            try:
                if room_limit and disk:
                    room.lock(session, row.owner)  # as a submit under the bound: one at a time
                    room.check(session, row.owner, disk, room_limit)
                if own.submits_per_minute or own.max_queued:
                    # last, so only a trial that is made counts; counted in this transaction,
                    # which sees the trials this pass made
                    self.limits.check(lambda: nullcontext(session), row.owner, own)
            except (InvalidInput, TooManyRequests) as exc:
                # as before its ask (the trials asked after it too): it is asked again later
                study, proposed, refused = search.load(before), asked_before, refused_before
                waiting = f"the next trial waits: {exc.message}"
                break
            made = crud.job_row(owner, spec, f"sweep:{row.id}:{trial.number}", disk)
            made["sweep"] = row.id
            made["params"] = dict(trial.params)
            crud.insert_job(session, made)
            done.new_jobs.append(made["id"])
            active += 1
        result = session.execute(
            update(SWEEPS)
            .where(SWEEPS.c.id == row.id, SWEEPS.c.proposed == row.proposed)
            .values(study=search.dump(study), proposed=proposed, message=waiting or refused)
        )
        if waiting is not None and waiting != row.message:
            log.info("sweep %s: %s", row.id, waiting)
        if not result.rowcount:  # type: ignore[attr-defined]
            raise RuntimeError("another pass changed the sweep meanwhile; it is done next time")
        if proposed >= limit and active == 0:
            ended = f"{proposed} trial(s) done" + (f"; {refused}" if refused else "")
            finish_sweep(session, row.id, "finished", ended)

    @staticmethod
    def _tell(study: Any, trial: Any, job: Any, metric: str) -> None:
        import optuna

        state = optuna.trial.TrialState
        value = (job.last_metrics or {}).get(metric)
        if job.status == "succeeded" and value is not None:
            study.tell(trial.number, value)
        elif job.status == STOPPED_EARLY:
            study.tell(trial.number, state=state.PRUNED)
        else:
            study.tell(trial.number, state=state.FAIL)

    def _prune(
        self, session: Session, study: Any, metric: str, live: list[tuple[Any, Any]], done: _Pass
    ) -> None:
        """Report the trials' new points; stop the running ones the pruner prunes."""
        import optuna

        points: dict[str, list[tuple[int, int, Any]]] = {}
        for r in session.execute(
            select(METRICS.c.job_id, METRICS.c.attempt, METRICS.c.step, METRICS.c.data).where(
                METRICS.c.job_id.in_([job.id for _, job in live])
            )
        ):
            points.setdefault(r.job_id, []).append((r.step, r.attempt, r.data))
        for frozen, job in live:
            trial = optuna.trial.Trial(study, frozen._trial_id)
            last = frozen.last_step if frozen.last_step is not None else -1
            seen: dict[int, float] = {}
            for step, _attempt, data in sorted(points.get(job.id, [])):
                value = (data or {}).get(metric)
                if isinstance(value, int | float) and step > last:
                    seen[step] = float(value)  # a resumed attempt's point replaces the first's
            pruned = False
            for step in sorted(seen):
                trial.report(seen[step], step)
                if trial.should_prune():
                    pruned = True
                    break
            if pruned and job.status == "running":  # one that ended already is told as it ended
                study.tell(frozen.number, state=optuna.trial.TrialState.PRUNED)
                done.outcome.extend(stop_early(session, job.id))
                done.stopping.append(job.id)

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.run_once()
            except Exception as exc:  # an outage: the next pass tries again
                log.warning("sweeps: %s", exc)
            stop.wait(self.settings.sweep_interval_s)
