"""Admission's decision, as a pure function over plain values: which waiting job starts on
which workers, which running ones yield, and why every other one waits (the order and rules
are service.api.scheduling.admit's docstring). ``Admitter`` reads the stores into these values
and acts on the ``Plan``; the benchmark and the tests build them directly.
"""

from __future__ import annotations

import heapq
import json
import logging
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

__all__ = [
    "Held",
    "Pending",
    "Plan",
    "Waiting",
    "Worker",
    "aware",
    "capacity",
    "decide",
    "live_entries",
    "units",
]

log = logging.getLogger(__name__)

# Queued jobs per queue whose pending reason is written one by one; the rest share a line.
PENDING_DETAIL = 200
# Owners named as "ahead" in a pending reason.
AHEAD_NAMES = 3
# What a placement charges its owner's fair-share use at once (slot-seconds per unit).
PLACE_CHARGE_S = 1.0


# -- The inputs of a decision, as plain values (the benchmark builds them directly) --------


@dataclass
class Worker:
    name: str
    queues: frozenset[str]
    slots: int
    slot_procs: int
    gpus_per_slot: int
    free: int


class Waiting(NamedTuple):
    """A queued job's current attempt, waiting for admission (a tuple: a pass reads 10,000
    of them, and a tuple is the cheapest to build from a row and to read fields of)."""

    job_id: str
    attempt: int
    owner: str
    queue: str
    nodes: int
    procs: int
    priority: int
    not_before: datetime | None = None
    since: datetime | None = None  # when this attempt began to wait (priority aging)


@dataclass
class Held:
    """A placed attempt not yet seen to end: it holds a slot on each of its workers."""

    job_id: str
    attempt: int
    owner: str
    queue: str
    nodes: int
    procs: int
    priority: int
    placement: list[str]
    created_at: datetime
    preempted_at: datetime | None
    status: str
    preemptions: int = 0  # times the job has yielded so far (its attempts ended preempted)

    @property
    def yielding(self) -> bool:
        """Asked to yield (preempted) after this attempt began: it is stopping."""
        return self.preempted_at is not None and aware(self.preempted_at) >= aware(self.created_at)


@dataclass(frozen=True)
class Pending:
    """Why a queued job waits, kept so that it can be told per viewer (``text``): its own
    owner (or an admin) reads it, and only an admin reads other owners' names or job ids.
    Stored as JSON in ``{prefix}:pending`` (service.api.scheduling.pending)."""

    why: str  # names no other owner, nor another owner's job
    owner: str = ""
    position: int = 0  # 0: not a position in the admission order (``why`` is all)
    queue: str = ""
    ahead: tuple[tuple[str, int], ...] = ()  # the owners with most jobs ahead, and how many
    ahead_total: int = 0  # jobs ahead of it that still wait
    ahead_own: int = 0  # ... of them its own owner's
    preempting: tuple[str, ...] = ()  # jobs asked to yield for it
    yielding: tuple[str, ...] = ()  # jobs of the queue checkpointing to yield
    aged: int = 0  # priority added for the time it waited

    def text(self, *, admin: bool) -> str:
        """The reason as its owner (``admin`` False: counts only for the others) or an admin
        (every name) reads it."""
        if not self.position:
            return self.why
        aged = f" (priority +{self.aged} for its time waiting)" if self.aged else ""
        out = f"position {self.position} in queue {self.queue}{aged}: {self.why}"
        if self.yielding:
            jobs = ", ".join(self.yielding) if admin else f"{len(self.yielding)}"
            out += f"; job(s) {jobs} are checkpointing to yield theirs"
        if self.preempting:
            jobs = ", ".join(self.preempting) if admin else f"{len(self.preempting)}"
            out += f"; preempting lower-priority job(s) {jobs}"
        if admin and self.ahead:
            out += "; ahead: " + ", ".join(f"{o} ({c})" for o, c in self.ahead)
        elif self.ahead_total:
            parts = [f"{self.owner} ({self.ahead_own})"] if self.ahead_own else []
            others = self.ahead_total - self.ahead_own
            if others:
                parts.append(f"other owners ({others})")
            out += "; ahead: " + ", ".join(parts)
        return out

    def dumps(self) -> str:
        return json.dumps(
            {k: v for k, v in self.__dict__.items() if v not in ("", 0, ())},
            separators=(",", ":"),
        )

    @classmethod
    def loads(cls, raw: str | bytes) -> Pending | None:
        """A stored record, or None if it is not one (a malformed or foreign value)."""
        try:
            data = json.loads(raw)
            if not isinstance(data, dict) or not isinstance(data.get("why"), str):
                return None
            for name in ("ahead", "preempting", "yielding"):
                data[name] = tuple(tuple(x) if isinstance(x, list) else x
                                   for x in data.get(name) or ())  # fmt: skip
            return cls(**data)
        except (ValueError, TypeError):
            return None


@dataclass
class Plan:
    """What one pass decided."""

    place: dict[tuple[str, int], list[str]] = field(default_factory=dict)
    preempt: list[tuple[Held, str]] = field(default_factory=list)  # victim, message
    # queue -> [(job id, reason)] in admission order (the first PENDING_DETAIL of each)
    reasons: dict[str, list[tuple[str, Pending]]] = field(default_factory=dict)
    summary: dict[str, dict[str, Any]] = field(default_factory=dict)  # per queue


def units(nodes: int, procs: int, gpu: bool) -> int:
    """What a job counts against quotas and fair share: GPUs on a GPU queue, else slots."""
    return nodes * procs if gpu else nodes


def decide(
    workers: list[Worker],
    waiting: Sequence[Waiting],
    held: list[Held],
    usage: Mapping[str, float],
    *,
    now: datetime,
    default_cap: int | None = None,
    caps: Mapping[str, int] | None = None,
    preempt_interval_s: float = 300.0,
    preemption: bool = True,
    aging_s: float = 0.0,
    aging_max: int = 0,
    preempt_budget: int = 0,
) -> Plan:
    """One admission decision over plain values: which waiting attempts go where, who is
    preempted, and why each of the others waits. ``workers[].free`` is consumed.

    Aging: a waiting attempt ranks ``+1`` priority per ``aging_s`` it has waited (since
    ``Waiting.since``, as of ``now``), at most ``+aging_max`` (0: no aging); it moves it up
    the admission order only, and preemption still compares base priorities. A job that
    has yielded ``preempt_budget`` times is no longer a victim (0: no budget)."""
    caps = caps or {}
    aged = {w.job_id: bonus for w in waiting if (bonus := _aged(w, now, aging_s, aging_max))}
    plan = Plan()
    usage = dict(usage)
    by_queue: dict[str, list[Waiting]] = defaultdict(list)
    for w in waiting:
        by_queue[w.queue].append(w)
    serving: dict[str, list[Worker]] = defaultdict(list)
    for wk in workers:
        for q in wk.queues:
            serving[q].append(wk)
    gpu_queue = {q: any(wk.gpus_per_slot for wk in ws) for q, ws in serving.items()}
    owner_held: dict[tuple[str, str], int] = defaultdict(int)
    held_by_queue: dict[str, list[Held]] = defaultdict(list)
    for h in held:
        owner_held[(h.owner, h.queue)] += units(h.nodes, h.procs, gpu_queue.get(h.queue, False))
        held_by_queue[h.queue].append(h)

    for queue in sorted(by_queue):
        jobs = by_queue[queue]
        workers_q = serving.get(queue, [])
        gpu = gpu_queue.get(queue, False)
        largest = max((wk.slot_procs for wk in workers_q), default=0)
        total_slots = sum(wk.slots for wk in workers_q)
        queue_free = sum(wk.free for wk in workers_q)
        reasons: list[tuple[str, Pending]] = []
        ahead: dict[str, int] = defaultdict(int)  # owner -> jobs ahead so far
        yielding = tuple(sorted({h.job_id for h in held_by_queue.get(queue, ()) if h.yielding}))
        # Only the first job that waits for capacity may preempt (one preemption at a time
        # per queue, and never for a job behind one that waits); none while one is under way.
        may_preempt = preemption and not yielding
        # Free slots that hold a given rank count; placements only take slots, so a job that
        # does not fit tells the same to every later one of its size (cleared on placement).
        fitting: dict[int, int] = {}
        position = placed = 0
        for job in _order(jobs, usage, gpu, aged):
            if position >= PENDING_DETAIL and queue_free == 0 and not may_preempt:
                break  # nothing more can start here; the rest share the summary line
            preempting: tuple[str, ...] = ()  # asked to yield for this job
            checkpointing: tuple[str, ...] = ()  # yielding while this one waits for capacity
            why = _why_not(
                job, workers_q, largest, total_slots, now, owner_held, default_cap, caps, gpu
            )
            if why is None:
                free = fitting.get(job.procs)
                if free is None:
                    free = sum(wk.free for wk in workers_q if wk.slot_procs >= job.procs)
                    fitting[job.procs] = free
                chosen = _place(job, workers_q) if free >= job.nodes else None
                if chosen is not None:
                    plan.place[(job.job_id, job.attempt)] = chosen
                    fitting.clear()
                    queue_free -= job.nodes
                    placed += 1
                    n = units(job.nodes, job.procs, gpu)
                    owner_held[(job.owner, queue)] += n
                    usage[job.owner] = usage.get(job.owner, 0.0) + n * PLACE_CHARGE_S
                    continue
                why = (
                    f"waiting for capacity: needs {job.nodes} slot(s) of {job.procs} rank(s)"
                    f" on queue {queue}, {free} free"
                )
                if yielding:
                    checkpointing = yielding
                elif may_preempt:
                    may_preempt = False
                    victims = _victims(job, workers_q, held_by_queue.get(queue, ()), now,
                                       preempt_interval_s, preempt_budget)  # fmt: skip
                    if victims:
                        msg = (
                            f"preempted by job {job.job_id} (priority {job.priority}) on queue"
                            f" {queue}; it resumes from its checkpoint when capacity frees"
                        )
                        plan.preempt += [(v, msg) for v in victims]
                        preempting = tuple(v.job_id for v in victims)
            position += 1  # among the jobs that still wait after this pass
            if position <= PENDING_DETAIL:
                before = sorted(ahead.items(), key=lambda kv: -kv[1])[:AHEAD_NAMES]
                reasons.append(
                    (
                        job.job_id,
                        Pending(
                            why,
                            owner=job.owner,
                            position=position,
                            queue=queue,
                            ahead=tuple(before),
                            ahead_total=position - 1,
                            ahead_own=ahead.get(job.owner, 0),
                            preempting=preempting,
                            yielding=checkpointing,
                            aged=aged.get(job.job_id, 0),
                        ),
                    )
                )
            ahead[job.owner] += 1
        plan.reasons[queue] = reasons
        plan.summary[queue] = {"queued": len(jobs) - placed, "detailed": len(reasons)}
    return plan


def _aged(job: Waiting, now: datetime, aging_s: float, aging_max: int) -> int:
    """The priority ``job`` has gained by waiting: +1 per ``aging_s``, at most ``aging_max``."""
    if aging_s <= 0 or aging_max <= 0 or job.since is None:
        return 0
    waited = (now - aware(job.since)).total_seconds()
    return max(0, min(aging_max, int(waited // aging_s)))


def _order(
    jobs: Sequence[Waiting],
    usage: Mapping[str, float],
    gpu: bool,
    aged: Mapping[str, int] | None = None,
) -> Iterable[Waiting]:
    """Admission order of one queue: priority (with what aging added), then the owner with
    the least decayed use (charged as each job is yielded, so owners of equal use
    alternate), then job id."""
    aged = aged or {}
    by_level: dict[int, dict[str, list[Waiting]]] = defaultdict(lambda: defaultdict(list))
    for j in jobs:
        by_level[j.priority + aged.get(j.job_id, 0)][j.owner].append(j)
    for priority in sorted(by_level, reverse=True):
        owners = by_level[priority]
        heap = []
        for owner, lst in owners.items():
            lst.sort()  # by job id, the tuple's first field
            heap.append((usage.get(owner, 0.0), lst[0].job_id, owner, 0))
        heapq.heapify(heap)
        used = {o: usage.get(o, 0.0) for o in owners}
        while heap:
            _, _, owner, i = heapq.heappop(heap)
            lst = owners[owner]
            job = lst[i]
            yield job
            used[owner] += units(job.nodes, job.procs, gpu) * PLACE_CHARGE_S
            if i + 1 < len(lst):
                heapq.heappush(heap, (used[owner], lst[i + 1].job_id, owner, i + 1))


def _why_not(
    job: Waiting,
    workers: list[Worker],
    largest: int,
    total_slots: int,
    now: datetime,
    owner_held: Mapping[tuple[str, str], int],
    default_cap: int | None,
    caps: Mapping[str, int],
    gpu: bool,
) -> str | None:
    """Why ``job`` cannot be placed whatever the free capacity, or None."""
    if job.not_before is not None and aware(job.not_before) > now:
        until = aware(job.not_before).strftime("%H:%M:%S")
        return f"backing off after its gang failed to start; next try after {until} UTC"
    if not workers:
        return f"no worker serves queue {job.queue}"
    if job.procs > largest:
        return f"needs {job.procs} per node; the largest slot on queue {job.queue} has {largest}"
    if job.nodes > total_slots:
        return (
            f"a gang of {job.nodes} nodes; queue {job.queue} has {total_slots} slot(s)"
            f" on {len(workers)} worker(s)"
        )
    cap = caps.get(job.owner, default_cap)
    if cap:  # None or 0: no cap
        have = owner_held.get((job.owner, job.queue), 0)
        need = units(job.nodes, job.procs, gpu)
        if have + need > cap:
            what = "GPUs" if gpu else "slots"
            return (
                f"waiting for quota: owner {job.owner} holds {have} of its {cap} {what}"
                f" on queue {job.queue}"
            )
    return None


def _place(job: Waiting, workers: list[Worker]) -> list[str] | None:
    """A worker for every node, or None; takes the slots from ``workers`` if it fits."""
    fit = [wk for wk in workers if wk.free > 0 and wk.slot_procs >= job.procs]
    if sum(wk.free for wk in fit) < job.nodes:
        return None
    fit.sort(key=lambda wk: (wk.free, wk.name))  # fullest first: keep big holes for gangs
    chosen: list[str] = []
    for wk in fit:
        take = min(wk.free, job.nodes - len(chosen))
        wk.free -= take
        chosen += [wk.name] * take
        if len(chosen) == job.nodes:
            return chosen
    return None  # not reached: the sum was checked


def _victims(
    job: Waiting,
    workers: list[Worker],
    held: Iterable[Held],
    now: datetime,
    interval_s: float,
    budget: int = 0,
) -> list[Held]:
    """The fewest, newest strictly-lower-priority placed attempts whose slots would let
    ``job`` be placed; [] if none would. A job that has yielded ``budget`` times already
    (0: no budget) is not a candidate."""
    cutoff = now - timedelta(seconds=interval_s)
    candidates = [
        h
        for h in held
        if h.priority < job.priority
        and not h.yielding
        and (h.preempted_at is None or aware(h.preempted_at) <= cutoff)
        and not (budget and h.preemptions >= budget)
    ]
    # Lowest priority first, then newest (it loses the least work).
    candidates.sort(key=lambda h: (h.priority, -aware(h.created_at).timestamp()))
    fits = [wk for wk in workers if wk.slot_procs >= job.procs]
    free = {wk.name: wk.free for wk in fits}

    def enough(chosen: list[Held]) -> bool:
        extra: dict[str, int] = defaultdict(int)
        for h in chosen:
            for name in h.placement:
                if name in free:
                    extra[name] += 1
        return sum(free.values()) + sum(extra.values()) >= job.nodes

    for h in candidates:  # one victim, if one is enough
        if enough([h]):
            return [h]
    chosen: list[Held] = []
    for h in candidates:
        chosen.append(h)
        if enough(chosen):
            return chosen
    return []


def live_entries(raw: Mapping[Any, Any], now: float, stale_s: float) -> list[dict[str, Any]]:
    """The registry hash (``{prefix}:workers``) as the entries seen within ``stale_s``, each
    with its ``name`` and ``age_s``; a malformed entry is not a live worker."""
    workers = []
    for name, value in raw.items():
        try:
            info = json.loads(value)
            ts = float(info["ts"])
        except (ValueError, KeyError, TypeError):
            continue
        if not isinstance(info, dict) or now - ts > stale_s:
            continue
        info.setdefault("name", name.decode() if isinstance(name, bytes) else str(name))
        info["age_s"] = max(0.0, now - ts)
        workers.append(info)
    return workers


def capacity(name: str, entry: Mapping[str, Any], placed: int = 0) -> Worker | None:
    """A registry entry as capacity: its slots less what is placed there or what it says
    it holds, whichever is more; None for an entry that is not well formed (one worker's
    bad entry must not stop admission for everyone)."""
    try:
        slots = int(entry.get("slots") or 1)
        busy = max(placed, int(entry.get("busy") or 0))
        queues = entry.get("queues") or ()
        if not isinstance(queues, list) or not all(isinstance(q, str) for q in queues):
            raise TypeError("queues is not a list of names")
        return Worker(
            name=name,
            queues=frozenset(queues),
            slots=slots,
            slot_procs=int(entry.get("slot_procs") or 8),
            gpus_per_slot=int(entry.get("gpus_per_slot") or 0),
            free=max(0, slots - busy),
        )
    except (TypeError, ValueError) as exc:
        log.warning("admit: worker %s has a malformed registry entry (%s); skipped", name, exc)
        return None


def aware(value: datetime) -> datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)
