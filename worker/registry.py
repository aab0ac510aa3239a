"""The worker's entry in ``{prefix}:workers``: queues, slots, GPUs and running jobs.

Refreshed every few seconds (the service treats an entry older than 15 s as dead) and at
once whenever an attempt starts or ends; a clean shutdown removes it.

``gpu_memory_bytes`` lists each GPU's memory, in ``gpus``' order, so the dry-run plan can
say whether a job fits the queue's devices. The worker never imports torch: it asks
``nvidia-smi`` once, at start (an argv list, a timeout); without it, or on a CPU worker, the
entry has ``gpu_memory_bytes: null`` and the plan says the memory is not known. The indices
are nvidia-smi's (PCI bus order), as ``--gpus`` names them under CUDA_DEVICE_ORDER=PCI_BUS_ID.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from worker.context import WorkerContext

__all__ = ["Registry", "gpu_memory_bytes", "parse_gpu_memory"]

log = logging.getLogger(__name__)

NVIDIA_SMI_QUERY = ["--query-gpu=index,memory.total", "--format=csv,noheader,nounits"]
NVIDIA_SMI_TIMEOUT_S = 10.0
MIB = 1 << 20


def parse_gpu_memory(text: str) -> dict[int, int]:
    """nvidia-smi's ``index, memory.total`` lines (MiB, no units) as index -> bytes; a line
    that is not two integers (``[N/A]``, a warning) is skipped."""
    found: dict[int, int] = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 2 or not all(p.isdigit() for p in parts):
            continue
        index, mib = int(parts[0]), int(parts[1])
        if mib > 0:
            found[index] = mib * MIB
    return found


def gpu_memory_bytes(gpus: Sequence[int] | None) -> list[int] | None:
    """Each of ``gpus``' memory in bytes, by nvidia-smi; None for a CPU worker, or when
    nvidia-smi is missing, fails, times out or does not list every one of ``gpus``."""
    if not gpus:
        return None
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        done = subprocess.run(
            [exe, *NVIDIA_SMI_QUERY],
            capture_output=True,
            text=True,
            timeout=NVIDIA_SMI_TIMEOUT_S,
            check=False,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("nvidia-smi did not answer, GPU memory unknown: %s", exc)
        return None
    found = parse_gpu_memory(done.stdout) if done.returncode == 0 else {}
    if not all(g in found for g in gpus):
        log.warning("nvidia-smi does not list every GPU of %s: GPU memory unknown", list(gpus))
        return None
    return [found[g] for g in gpus]


class Registry:
    """``on_reach(ok)`` after each refresh: whether Redis answered it (worker.intake)."""

    def __init__(self, ctx: WorkerContext, on_reach: Callable[[bool], None] | None = None) -> None:
        self.ctx = ctx
        self._on_reach = on_reach
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._changed = True  # a change to announce on the admitter's channel
        self._unreachable = False  # Redis did not answer the last update
        ctx.on_change(self._change)
        self.gpu_memory = gpu_memory_bytes(ctx.gpus)  # asked once: it does not change

    def _change(self) -> None:
        self._changed = True
        self._wake.set()

    def entry(self) -> dict[str, Any]:
        ctx = self.ctx
        per_slot = len(ctx.gpus) // ctx.slot_count if ctx.gpus else None
        return {
            "name": ctx.name,
            "host": ctx.host,
            "queues": ctx.queues,
            "slots": ctx.slot_count,
            "gpus": ctx.gpus,
            "gpu_memory_bytes": self.gpu_memory,  # per GPU, in gpus' order; None: unknown
            # The ranks one slot holds: its GPUs, or the CPU worker's slot_procs setting.
            "slot_procs": per_slot or ctx.settings.slot_procs,
            "gpus_per_slot": per_slot or 0,
            "running": ctx.running_jobs(),
            "busy": ctx.busy_slots(),
            "draining": ctx.preempt.is_set(),  # shutting down: takes no new work
            "ts": time.time(),
        }

    def publish(self) -> bool:
        """Write the entry; after a change (a start, an attempt starting or ending, a
        shutdown) also wake the service's admitter, which places work by these entries."""
        changed, self._changed = self._changed, False
        try:
            keys = self.ctx.keys
            if changed:
                pipe = self.ctx.redis.pipeline(transaction=False)
                pipe.hset(keys.workers, self.ctx.name, json.dumps(self.entry()))
                pipe.publish(keys.admit_channel, self.ctx.name)
                pipe.execute()
            else:
                self.ctx.redis.hset(keys.workers, self.ctx.name, json.dumps(self.entry()))
        except Exception as exc:
            # Its entry goes stale and the service counts it gone; its attempts' heartbeats
            # expire with it (worker.watchers), and it stops consuming (worker.intake): the
            # broker may well be reachable when Redis is not. Said once per outage.
            self._changed = True
            if self._on_reach is not None:
                self._on_reach(False)
            if not self._unreachable:
                self._unreachable = True
                log.error(
                    "worker %s cannot reach Redis (%s): it takes no work and leaves the"
                    " registry until Redis answers again",
                    self.ctx.name,
                    exc,
                )
            return False
        if self._on_reach is not None:
            self._on_reach(True)
        if self._unreachable:
            self._unreachable = False
            log.warning("worker %s reaches Redis again: back in the registry", self.ctx.name)
        return True

    def start(self) -> None:
        if self._thread is not None:
            return
        self.publish()
        self._thread = threading.Thread(target=self._run, name="registry", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.ctx.settings.registry_interval_s)
            self._wake.clear()
            if not self._stop.is_set():
                self.publish()

    def stop(self) -> None:
        """Stop refreshing and remove the entry (a clean shutdown)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(5)
        try:
            self.ctx.redis.hdel(self.ctx.keys.workers, self.ctx.name)
            self.ctx.redis.publish(self.ctx.keys.admit_channel, self.ctx.name)
        except Exception as exc:
            log.warning("could not remove worker %s from the registry: %s", self.ctx.name, exc)
