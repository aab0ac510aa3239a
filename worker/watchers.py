"""The two background loops of a running attempt: its heartbeat, and the cancel watch.

Both survive Redis being unreachable: a failed call is retried on the next round, and the
run itself is never disturbed by it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["CancelWatch", "Heartbeat"]


class Heartbeat:
    """SETs the attempt's heartbeat key with a TTL, refreshed every ttl/3.

    After Redis was out of reach for longer than the TTL, the key has expired and the
    service may have called the attempt lost and started the next one elsewhere, or not (an
    outage of Redis for everyone: nobody saw the key go). Which one, only Redis can say, so
    the first beat that gets through again asks ``superseded()`` (worker.supervise reads the
    job's fence, trainer.fence, and the attempt's stop key, which the service sets when it
    calls an attempt lost); if it was, ``lost`` is set and ``on_lost`` called, and the
    worker stops its half of a run that is no longer the job's.
    """

    def __init__(
        self,
        client: Any,
        key: str,
        value: str,
        ttl_s: float,
        *,
        superseded: Callable[[], bool] | None = None,
        on_lost: Callable[[], None] | None = None,
    ) -> None:
        self._client, self._key, self._value = client, key, value
        self._ttl_s = ttl_s
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._every = ttl_s / 3
        self._stop = threading.Event()
        self._superseded, self._on_lost = superseded, on_lost
        self.lost = threading.Event()
        self.outage_s = 0.0  # how long the last outage of Redis lasted, as this beat saw it
        self._last_ok = time.monotonic()
        self.beat()
        self._thread = threading.Thread(target=self._run, name=f"hb-{key}", daemon=True)
        self._thread.start()

    def beat(self) -> bool:
        try:
            self._client.set(self._key, self._value, px=self._ttl_ms)
        except Exception as exc:  # redis.ConnectionError, TimeoutError: next round retries
            log.warning("heartbeat %s failed: %s", self._key, exc)
            return False
        now = time.monotonic()
        gone, self._last_ok = now - self._last_ok, now
        if gone > self._ttl_s and self._superseded is not None and not self.lost.is_set():
            self.outage_s = gone
            try:
                superseded = self._superseded()
            except Exception as exc:  # gone again: the next beat that gets through asks
                log.warning("heartbeat %s: %s", self._key, exc)
                self._last_ok = now - gone
                return True
            if superseded:
                self.lost.set()
                if self._on_lost is not None:
                    self._on_lost()
        return True

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            self.beat()

    def stop(self) -> None:
        """Stop beating; the key expires on its own (the exit event may be unsent)."""
        self._stop.set()
        self._thread.join(5)

    def hand_over(self, marker: str, ttl_s: float) -> None:
        """Stop beating and replace the key by ``marker`` (with its own TTL) in one
        transaction, so that at no moment neither exists: the exit event is sent, and the
        reaper must wait for its ingestion rather than call the attempt lost."""
        self.stop()
        try:
            pipe = self._client.pipeline(transaction=True)
            pipe.set(marker, self._value, px=max(1, int(ttl_s * 1000)))
            pipe.delete(self._key)
            pipe.execute()
        except Exception as exc:  # the heartbeat expires on its own; the exit is sent
            log.warning("could not replace heartbeat %s by %s: %s", self._key, marker, exc)


class CancelWatch:
    """Sets ``requested`` once the cancel key exists. Pub/sub wakes it; the key is the truth.

    Pub/sub is at most once (a message sent while we were reconnecting is gone), so the key
    is also read every ``poll_s`` whatever the channel says. It also watches ``stop_key``
    (the service ended the attempt: another node failed, or it called the attempt lost while
    this host was cut off); finding it sets ``requested`` too, and ``stopped``. So does
    ``preempt_key`` (the service's admitter wants the attempt's capacity for a
    higher-priority job), with ``preempted``; its value is the admitter's message.
    """

    def __init__(
        self,
        client: Any,
        *,
        key: str,
        channel: str,
        job_id: str,
        poll_s: float,
        wake: threading.Event,
        stop_key: str | None = None,
        preempt_key: str | None = None,
    ) -> None:
        self._client, self._key, self._channel = client, key, channel
        self._stop_key = stop_key
        self._preempt_key = preempt_key
        self.preempted: str | None = None  # the admitter's message, once preempted
        self._poll_s = poll_s
        self._wake = wake
        self.requested = threading.Event()
        self.stopped = False  # requested by the stop key, not by a cancel
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"cancel-{job_id}", daemon=True)

    def check(self) -> bool:
        try:
            if self._client.exists(self._key):
                self.requested.set()
                self._wake.set()
            elif self._stop_key is not None and self._client.exists(self._stop_key):
                self.stopped = True
                self.requested.set()
                self._wake.set()
            elif self._preempt_key is not None:
                why = self._client.get(self._preempt_key)
                if why is not None:
                    self.preempted = (
                        why.decode(errors="replace") if isinstance(why, bytes) else str(why)
                    )
                    self.requested.set()
                    self._wake.set()
        except Exception as exc:
            log.debug("cancel check failed: %s", exc)
        return self.requested.is_set()

    def cancelled(self) -> bool:
        """Whether the job's cancel key is set now (a Redis error reads as not): a stop that
        began as a preemption, or a shutdown, and that the user then cancelled is theirs."""
        try:
            return bool(self._client.exists(self._key))
        except Exception as exc:
            log.debug("cancel check failed: %s", exc)
            return False

    def start(self) -> CancelWatch:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set() and not self.requested.is_set():
            pubsub = None
            try:
                pubsub = self._client.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(self._channel)
                while not self._stop.is_set():
                    # Any message, ours or another job's, or the poll timeout: read the key.
                    pubsub.get_message(timeout=self._poll_s)
                    if self._stop.is_set() or self.check():
                        return
            except Exception as exc:
                log.debug("cancel channel lost (%s); polling until it is back", exc)
                if self._stop.is_set() or self.check():
                    return
                self._stop.wait(self._poll_s)
            finally:
                if pubsub is not None:
                    try:
                        pubsub.close()
                    except Exception:
                        pass

    def stop(self) -> None:
        """Stop watching, without waiting: the thread may sit in a pub/sub read for up to
        ``poll_s``, and the attempt's exit must not wait for it. It ends by itself on its next
        wake-up, reads nothing more and closes its connection."""
        self._stop.set()
