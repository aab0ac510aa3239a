"""The deliverer: fans events out to endpoints and sends them, signed, retried, in order.

Runs as a thread of the API process (``TRAINQ_WEBHOOK_DELIVER``, the default) or as a
process of its own, ``python -m service.api.webhooks.delivery`` (with
``TRAINQ_WEBHOOK_DELIVER=false`` on the API processes), so that sending never competes with
requests for the API's CPU; any number of either share the work through the database.

One loop does the SQL, in batches (``service.api.webhooks.store``): new events become
deliveries, due deliveries are claimed, outcomes are stored. The sending is done by a
``Lane`` per endpoint: ``webhook_per_endpoint`` threads, each with its own kept-alive
connection (``sender.Connection``), and a bound on how many of the endpoint's deliveries it
holds at once; an endpoint at its bound is not claimed for, so a slow or hostile endpoint
ties up only its own lane (its sends time out after ``webhook_timeout_s``), never the other
owners' deliveries or the loop.

Signed per the Standard Webhooks spec with the ``standardwebhooks`` package: ``webhook-id``
(``msg_<event id>``: the same for every try of one event, so a receiver can drop a
duplicate; delivery is at least once), ``webhook-timestamp`` (when sent),
``webhook-signature`` (HMAC-SHA256 of ``id.timestamp.body`` under the endpoint's secret).
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
from collections import deque
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import update
from sqlalchemy.orm import Session, sessionmaker
from standardwebhooks import Webhook

from service.api.core.models import WEBHOOK_DELIVERIES, utcnow
from service.api.core.settings import Settings
from service.api.events.schemas import EventBody
from service.api.webhooks.sender import Connection, SendFailed
from service.api.webhooks.store import (
    Claimed,
    Endpoint,
    Outcome,
    claim,
    enabled_endpoints,
    fan_out,
    lazy_commit,
    record_outcomes,
    renew_lease,
)

__all__ = ["Deliverer", "Lane", "main", "signed_request"]

log = logging.getLogger(__name__)

# A claimed delivery is held for ``webhook_lease_s`` (a minute by default): its deliverer
# renews the lease of every delivery it holds each third of that, so a deliverer that died
# (killed, its host gone) leaves its deliveries to the others within a lease, however long
# its lanes' queues were; one that lives holds them however long its sends take.
RENEW_SHARE = 1 / 3
LANE_IDLE_S = 60.0
# Deliveries an endpoint's lane holds per sender thread: enough that a claim is worth its
# query, few enough that a slow endpoint's lane does not sit on many for long.
LANE_DEPTH = 64
FAN_OUT_BATCH = 2000
# While deliveries are in flight, a pass follows the last after this long: the outcomes of
# that time are stored and as many deliveries claimed in one transaction. A lane holds far
# more than it sends in that time (LANE_DEPTH), so the senders never wait for a pass.
BATCH_S = 0.05


def signed_request(signer: Webhook, delivery: Claimed) -> tuple[bytes, dict[str, str]]:
    """The body ``{"type", "timestamp", "data"}`` and the Standard Webhooks headers."""
    body = (
        EventBody(type=delivery.type, timestamp=delivery.created_at, data=delivery.data)
        .model_dump_json()
        .encode()
    )
    msg_id = f"msg_{delivery.event_id}"
    now = datetime.now(UTC)
    return body, {
        "webhook-id": msg_id,
        "webhook-timestamp": str(int(now.timestamp())),
        "webhook-signature": signer.sign(msg_id, now, body),
    }


class Lane:
    """One endpoint's senders: threads taking its deliveries from one queue."""

    def __init__(self, endpoint: Endpoint, settings: Settings, done: Any) -> None:
        self.endpoint = endpoint
        self.signer = Webhook(endpoint.secret)
        self.settings = settings
        self.done = done  # called with each Outcome
        self.capacity = settings.webhook_per_endpoint * LANE_DEPTH
        self.held = 0  # queued or being sent; changed under the lock
        self.lock = threading.Lock()
        self.last_used = time.monotonic()
        self.queue: queue.SimpleQueue[Claimed | None] = queue.SimpleQueue()
        self.threads = [
            threading.Thread(target=self._run, name=f"webhook-{endpoint.id}-{n}", daemon=True)
            for n in range(settings.webhook_per_endpoint)
        ]
        for t in self.threads:
            t.start()

    def room(self) -> int:
        with self.lock:
            return self.capacity - self.held

    def put(self, delivery: Claimed) -> None:
        with self.lock:
            self.held += 1
        self.last_used = time.monotonic()
        self.queue.put(delivery)

    def close(self) -> list[Claimed]:
        """Stop the threads (after their current send); the deliveries never started."""
        left = []
        while True:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                left.append(item)
        for _ in self.threads:
            self.queue.put(None)
        return left

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def _run(self) -> None:
        s = self.settings
        conn = Connection(
            self.endpoint.url,
            timeout_s=s.webhook_timeout_s,
            max_response_bytes=s.webhook_max_response_bytes,
            allow_private=s.webhook_allow_loopback,
        )
        try:
            while True:
                delivery = self.queue.get()
                if delivery is None:
                    return
                try:
                    body, headers = signed_request(self.signer, delivery)
                    status = conn.post(body, headers)
                    outcome = Outcome(delivery, True, status, None)
                except SendFailed as exc:
                    outcome = Outcome(delivery, False, exc.status, str(exc))
                except Exception as exc:  # a bug must not end the lane, nor lose the delivery
                    log.exception("webhook delivery %s failed unexpectedly", delivery.id)
                    outcome = Outcome(delivery, False, None, f"internal error: {exc!r}"[:300])
                with self.lock:
                    self.held -= 1
                self.last_used = time.monotonic()
                self.done(outcome)
        finally:
            conn.close()


class Pace:
    """A token bucket: ``take(n)`` is how many of ``n`` may start now, at ``per_s`` a second
    with bursts of a quarter second's worth (so a pass every BATCH_S still claims some);
    ``per_s`` 0 never bounds."""

    BURST_S = 0.25

    def __init__(self, per_s: float) -> None:
        self.per_s = per_s
        self.size = max(1.0, per_s * self.BURST_S)
        self.tokens = self.size
        self.at = time.monotonic()

    def take(self, n: int) -> int:
        if self.per_s <= 0 or n <= 0:
            return max(n, 0)
        now = time.monotonic()
        self.tokens = min(self.size, self.tokens + (now - self.at) * self.per_s)
        self.at = now
        got = min(n, int(self.tokens))
        self.tokens -= got
        return got

    def give_back(self, n: int) -> None:
        """Tokens taken for deliveries that were not claimed after all."""
        if self.per_s > 0 and n > 0:
            self.tokens = min(self.size, self.tokens + n)

    def wait_s(self) -> float:
        """Seconds until a delivery may start (0 if one may now)."""
        if self.per_s <= 0 or self.tokens >= 1:
            return 0.0
        return (1 - self.tokens) / self.per_s


class Deliverer:
    """The loop; ``run_once`` is one pass (fan out, store outcomes, claim and hand out)."""

    def __init__(self, settings: Settings, sessions: sessionmaker[Session]) -> None:
        self.settings = settings
        self.sessions = sessions
        self.lanes: dict[str, Lane] = {}
        self.outcomes: deque[Outcome] = deque()
        self.wake = threading.Event()
        self.sent = 0
        self.endpoints: list[Endpoint] = []
        self.lease_s = settings.webhook_lease_s
        self.holding: set[int] = set()  # claimed by this deliverer, outcome not yet stored
        self._next_fan_out = 0.0
        self._next_renew = 0.0
        self.pace = Pace(settings.webhook_max_per_s)
        self.paced = False  # the last pass claimed all the pace allowed: more may wait

    def _done(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)
        self.wake.set()

    def held(self) -> int:
        return sum(lane.capacity - lane.room() for lane in self.lanes.values())

    def _lanes_for(self, endpoints: list[Endpoint]) -> None:
        current = {e.id: e for e in endpoints}
        for endpoint_id, lane in list(self.lanes.items()):
            endpoint = current.get(endpoint_id)
            idle = lane.room() == lane.capacity and (
                time.monotonic() - lane.last_used > LANE_IDLE_S
            )
            changed = endpoint is None or (endpoint.url, endpoint.secret) != (
                lane.endpoint.url,
                lane.endpoint.secret,
            )
            if idle or (changed and lane.room() == lane.capacity):
                lane.close()
                del self.lanes[endpoint_id]
        for endpoint in endpoints:
            if endpoint.id not in self.lanes:
                try:
                    self.lanes[endpoint.id] = Lane(endpoint, self.settings, self._done)
                except Exception as exc:  # its secret unusable, say: its deliveries wait
                    log.error("webhook endpoint %s has no lane: %s", endpoint.id, exc)

    def _take_outcomes(self) -> list[Outcome]:
        batch = []
        while self.outcomes:
            batch.append(self.outcomes.popleft())
        return batch

    def _stored(self, batch: list[Outcome], disabled: list[str]) -> None:
        self.holding.difference_update(o.delivery.id for o in batch)
        for endpoint_id in disabled:
            log.warning("webhook endpoint %s disabled after failing deliveries", endpoint_id)
        self.sent += sum(1 for o in batch if o.ok)

    def store_outcomes(self) -> int:
        """Store the outcomes gathered so far, in a transaction of their own."""
        batch = self._take_outcomes()
        if not batch:
            return 0
        try:
            with self.sessions() as session, session.begin():
                lazy_commit(session)
                disabled = record_outcomes(session, self.settings, batch)
        except Exception:
            self.outcomes.extendleft(reversed(batch))  # stored on the next pass instead
            raise
        self._stored(batch, disabled)
        return len(batch)

    def run_once(self) -> int:
        """One pass; the number of deliveries claimed and outcomes stored.

        The endpoints are read, and new events fanned out, every ``webhook_poll_s`` (at once
        again while a full batch of events was read); the outcomes gathered since the last
        pass are stored and the next deliveries claimed in one transaction, so a busy pass
        costs the database one commit however many deliveries it handles."""
        now = time.monotonic()
        if now >= self._next_fan_out:
            with self.sessions() as session, session.begin():
                lazy_commit(session)
                self.endpoints = enabled_endpoints(session)
                read = fan_out(session, self.endpoints, self.settings, FAN_OUT_BATCH)
            # a full batch: more are waiting, read on at once; else at the poll interval
            self._next_fan_out = 0.0 if read == FAN_OUT_BATCH else now + self._poll_s()
            self._lanes_for(self.endpoints)
        enabled = {e.id for e in self.endpoints}
        rooms = {eid: lane.room() for eid, lane in self.lanes.items() if eid in enabled}
        want = self.settings.webhook_in_flight - self.held()
        roomy = any(room > 0 for room in rooms.values())
        free = self.pace.take(want) if roomy else 0
        self.paced = roomy and free < want  # the pace bound it (not full lanes, not none set)
        if free <= 0:
            rooms = {}
        batch = self._take_outcomes()
        renew = bool(self.holding) and now >= self._next_renew
        if not batch and not rooms and not renew:
            return 0
        try:
            with self.sessions() as session, session.begin():
                lazy_commit(session)
                disabled = record_outcomes(session, self.settings, batch)
                if renew:  # the ones whose outcome was just stored are no longer held
                    held = self.holding.difference(o.delivery.id for o in batch)
                    renew_lease(session, sorted(held), self.lease_s)
                claimed = claim(session, limit=free, rooms=rooms, lease_s=self.lease_s)
        except Exception:
            self.outcomes.extendleft(reversed(batch))  # stored on the next pass instead
            self.pace.give_back(free)
            raise
        self.pace.give_back(max(free, 0) - len(claimed))
        self.paced = self.paced and len(claimed) == free  # the pace, not the backlog, bound it
        if renew:
            self._next_renew = now + self.lease_s * RENEW_SHARE
        self._stored(batch, disabled)
        if claimed and not self.holding:
            self._next_renew = now + self.lease_s * RENEW_SHARE  # the first held since idle
        self.holding.update(d.id for d in claimed)
        for delivery in claimed:
            self.lanes[delivery.endpoint_id].put(delivery)
        return len(batch) + len(claimed)

    def _poll_s(self) -> float:
        return self.settings.webhook_poll_s

    def run(self, stop: threading.Event) -> None:
        """Loop until ``stop`` is set; outages are logged and retried, never fatal."""
        backoff = 0.5
        while not stop.is_set():
            try:
                worked = self.run_once()
                backoff = 0.5
            except Exception as exc:  # the database away: wait and try again
                log.warning("webhooks: %s; retrying in %.1fs", exc, backoff)
                stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)
                continue
            if self.paced:  # a backlog held back by the pace: the next pass when it allows
                stop.wait(max(BATCH_S, self.pace.wait_s()))
            elif self.held() or worked:
                # outcomes come back as sends end: gather them for BATCH_S, so that a pass
                # (one transaction) stores and claims many deliveries, not one or two
                stop.wait(BATCH_S)
                self.wake.wait(self._poll_s())
            else:
                self.wake.wait(self._poll_s())
            self.wake.clear()
        self.close()

    def close(self, timeout: float | None = None) -> None:
        """Stop the lanes; deliveries not yet started go back to pending for anyone."""
        unstarted: list[int] = []
        for lane in self.lanes.values():
            unstarted.extend(d.id for d in lane.close())
        self.holding.difference_update(unstarted)
        for lane in self.lanes.values():
            lane.join(self.settings.webhook_timeout_s * 2 if timeout is None else timeout)
        self.lanes.clear()
        try:
            self.store_outcomes()
            if unstarted:
                with self.sessions() as session, session.begin():
                    session.execute(
                        update(WEBHOOK_DELIVERIES)
                        .where(
                            WEBHOOK_DELIVERIES.c.id.in_(unstarted),
                            WEBHOOK_DELIVERIES.c.status == "sending",
                        )
                        .values(status="pending", next_attempt_at=utcnow())
                    )
        except Exception as exc:  # left as sending: taken again once their lease ends
            log.warning("webhooks: could not release %d deliveries: %s", len(unstarted), exc)


def main() -> None:
    """``python -m service.api.webhooks.delivery``: the deliverer as a process of its own."""
    from service.api.core.db import make_engine, make_sessionmaker

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    settings = Settings()
    if settings.webhook_nice:
        # Below the API's CPU priority: on a shared host the API's requests come first, and
        # deliveries take what CPU is left (they are retried anyway; nothing is lost).
        os.nice(settings.webhook_nice)
    engine = make_engine(settings)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    log.info("webhook deliverer started")
    try:
        Deliverer(settings, make_sessionmaker(engine)).run(stop)
    finally:
        engine.dispose()


if __name__ == "__main__":
    main()
