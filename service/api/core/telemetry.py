"""Prometheus metrics of the service itself (``GET /metrics``), one registry per app.

Request latency is observed by the edge middleware; jobs by status, queue depth and ingest
lag are read when scraped (a GROUP BY and an XINFO), so nothing counts them on the hot path.
A store that is down at scrape time leaves its metrics out rather than failing the scrape.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, select

from service.api.core.models import JOBS

if TYPE_CHECKING:
    from service.api.core.deps import Services

__all__ = ["build_registry"]

log = logging.getLogger(__name__)


class _StoreCollector(Collector):
    def __init__(self, services: Services) -> None:
        self.services = services

    def _served_queues(self) -> set[str]:
        try:
            workers = self.services.live_workers()
        except Exception:  # Redis down: every queue counts as other
            return set()
        return {q for w in workers for q in w.get("queues") or () if isinstance(q, str)}

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            with self.services.sessions() as session:
                by_status = list(
                    session.execute(select(JOBS.c.status, func.count()).group_by(JOBS.c.status))
                )
                depth = list(
                    session.execute(
                        select(JOBS.c.queue, func.count())
                        .where(JOBS.c.status == "queued")
                        .group_by(JOBS.c.queue)
                    )
                )
        except Exception as exc:  # the database is down: scrape what remains
            log.debug("metrics: database unavailable: %s", exc)
        else:
            jobs = GaugeMetricFamily("trainq_jobs", "Jobs by status", labels=["status"])
            for status, n in by_status:
                jobs.add_metric([status], n)
            yield jobs
            yield _queue_depth(depth, self._served_queues())
        settings = self.services.settings
        try:
            groups = self.services.redis.xinfo_groups(self.services.keys.events)
        except Exception as exc:  # no stream yet, or Redis down
            log.debug("metrics: no ingest info: %s", exc)
            return
        for group in groups:
            name = group.get("name")
            if (name.decode() if isinstance(name, bytes) else name) != settings.consumer_group:
                continue
            lag = GaugeMetricFamily(
                "trainq_ingest_lag_entries", "Events not yet read by the ingestor"
            )
            lag.add_metric([], float(group.get("lag") or 0))
            yield lag
            pending = GaugeMetricFamily(
                "trainq_ingest_pending_entries", "Events read but not yet committed and acked"
            )
            pending.add_metric([], float(group.get("pending") or 0))
            yield pending


# The queue label's value for queues no live worker serves: a spec's queue is the user's
# string, and one series per string would let any tenant grow the scrape without bound.
OTHER_QUEUES = "_other"


def _queue_depth(depth: list[Any], served: set[str]) -> GaugeMetricFamily:
    """Queued jobs per queue that a live worker serves (operators name those), the rest
    summed under ``OTHER_QUEUES``: at most one series per served queue, plus one."""
    counts: dict[str, int] = dict.fromkeys(sorted(served), 0)
    for queue, n in depth:
        label = queue if queue in served else OTHER_QUEUES
        counts[label] = counts.get(label, 0) + int(n)
    family = GaugeMetricFamily(
        "trainq_queue_depth",
        f"Queued jobs per served queue; queues no worker serves are summed as {OTHER_QUEUES}",
        labels=["queue"],
    )
    for label, n in counts.items():
        family.add_metric([label], n)
    return family


def build_registry(services: Services) -> tuple[CollectorRegistry, Callable[..., None]]:
    registry = CollectorRegistry()
    latency = Histogram(
        "trainq_request_seconds",
        "HTTP request latency",
        ["method", "route", "status"],
        registry=registry,
        buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10),
    )
    registry.register(_StoreCollector(services))

    def observe(method: str, route: str, status: int, seconds: float, *_: Any) -> None:
        latency.labels(method, route, str(status)).observe(seconds)

    return registry, observe
