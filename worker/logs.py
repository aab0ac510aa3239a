"""Log forwarding: torchrun's stdout and stderr, tagged with rank and stream, as log events.

torchrun tees each rank's output to its own streams with a ``[rank{N}]:`` prefix
(launch.LOG_LINE_PREFIX, the global rank); lines without it are torchrun's own (rank null).
In a multi-node attempt every line also carries its ``node``. Lines are
batched into one ``log`` event per ``batch_lines`` or ``batch_s``, whichever comes first,
and the last lines are kept for the exit message: the ranks' own (their traceback, their
last step), torchrun's only when no rank printed anything.

An attempt forwards at most ``max_lines`` lines as they come; past that, only its last
``keep_last`` lines are held, and at the end they follow one line that says how many were
not kept. A run that prints without end then costs Redis and the store a bounded amount,
and its stored log still ends with what it printed last (the traceback, the final step).
"""

from __future__ import annotations

import re
import threading
from collections import deque
from typing import IO, Any, Literal, Protocol

__all__ = ["LogForwarder", "parse_line"]

Stream = Literal["stdout", "stderr"]
_PREFIX = re.compile(r"\[rank(\d+)\]:")
MAX_LINE = 8192  # longer lines are cut: one runaway print must not make a huge event


class _Emitter(Protocol):
    def emit(self, kind: Any, data: dict[str, Any]) -> Any: ...


def parse_line(raw: bytes) -> tuple[int | None, str]:
    """(rank, text) of one line of torchrun output."""
    text = raw.decode("utf-8", errors="replace").rstrip("\r\n")
    m = _PREFIX.match(text)
    if m:
        return int(m.group(1)), text[m.end() :][:MAX_LINE]
    return None, text[:MAX_LINE]


class LogForwarder:
    def __init__(
        self,
        publisher: _Emitter,
        *,
        batch_lines: int = 200,
        batch_s: float = 0.25,
        tail_lines: int = 20,
        agent_lines: int = 400,
        node: int | None = None,
        max_lines: int = 200_000,
        keep_last: int = 2_000,
    ) -> None:
        self._pub = publisher
        self._node = node  # a multi-node attempt tags every line with its node
        self._batch_lines = batch_lines
        self._batch_s = batch_s
        self._lock = threading.Lock()
        self._pending: list[dict[str, Any]] = []
        self.tail: deque[str] = deque(maxlen=tail_lines)  # the ranks' last lines
        # torchrun's own lines (its failure summary names the failed rank's exit code).
        self.agent: deque[str] = deque(maxlen=agent_lines)
        self._tail_lines = tail_lines
        self.lines = 0
        self._max_lines = max_lines
        self._held: deque[dict[str, Any]] = deque(maxlen=keep_last)  # past max_lines
        self._readers: list[threading.Thread] = []
        self._stop = threading.Event()
        self._waiting = threading.Event()  # lines are pending: the ticker has a batch to time
        self._ticker = threading.Thread(target=self._tick, name="log-batch", daemon=True)
        self._ticker.start()

    def attach(self, stream: IO[bytes], name: Stream) -> None:
        t = threading.Thread(
            target=self._read, args=(stream, name), name=f"log-{name}", daemon=True
        )
        t.start()
        self._readers.append(t)

    def _read(self, stream: IO[bytes], name: Stream) -> None:
        try:
            for raw in iter(stream.readline, b""):
                rank, text = parse_line(raw)
                self._add(rank, name, text)
        except (OSError, ValueError):  # the pipe was closed under us
            pass

    def _add(self, rank: int | None, stream: Stream, text: str) -> None:
        with self._lock:
            item: dict[str, Any] = {"rank": rank, "stream": stream, "line": text}
            if self._node is not None:
                item["node"] = self._node
            self.lines += 1
            if self.lines <= self._max_lines:
                self._pending.append(item)
            else:
                self._held.append(item)
            if rank is None:
                self.agent.append(text)
            else:
                self.tail.append(f"[rank{rank}] {text}")
            if len(self._pending) >= self._batch_lines:
                self._emit_locked()
            else:
                self._waiting.set()

    def last_lines(self) -> list[str]:
        """The lines an exit message quotes: the ranks' last ones; torchrun's last ones when
        no rank printed anything (it failed before starting them)."""
        with self._lock:
            if self.tail:
                return list(self.tail)
            return list(self.agent)[-self._tail_lines :]

    def _emit_locked(self) -> None:
        if self._pending:
            self._pub.emit("log", {"lines": self._pending})
            self._pending = []

    def _own(self, text: str) -> dict[str, Any]:
        """A line of the worker's own (rank null, like torchrun's), marked ``trainq:``."""
        item: dict[str, Any] = {"rank": None, "stream": "stderr", "line": f"trainq: {text}"}
        if self._node is not None:
            item["node"] = self._node
        return item

    def _tick(self) -> None:
        """Sends what waits ``batch_s`` after the first line of a batch arrived. Asleep while
        nothing is pending: a quiet run costs no wake-ups."""
        while True:
            self._waiting.wait()
            if self._stop.wait(self._batch_s):
                return
            with self._lock:
                self._emit_locked()
                self._waiting.clear()

    def close(self, timeout: float = 5.0, last_line: str | None = None) -> None:
        """Read to EOF (bounded: a stray process may hold a pipe), then emit what is left,
        and ``last_line`` after it: the worker's own closing line (why it stopped the run)."""
        for t in self._readers:
            t.join(timeout)
        self._stop.set()
        self._waiting.set()
        self._ticker.join(timeout)
        with self._lock:
            last = list(self._held)
            self._held.clear()
            if self.lines - self._max_lines > len(last):
                note = self._own(
                    f"{self.lines - self._max_lines - len(last)} log lines not kept:"
                    f" this attempt printed {self.lines}, past the cap of {self._max_lines};"
                    f" its last {len(last)} follow"
                )
                last.insert(0, note)
            if last_line is not None:
                last.append(self._own(last_line))
            for item in last:  # in batches, as they would have gone
                self._pending.append(item)
                if len(self._pending) >= self._batch_lines:
                    self._emit_locked()
            self._emit_locked()
