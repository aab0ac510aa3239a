"""Chat templates a tenant sent, rendered in a child process the worker can kill.

Jinja2's sandbox stops a template reaching Python's internals, not burning CPU or memory:
``{{ (9**9)**(9**9) }}`` is one big-integer power that holds the interpreter for hours,
``{{ 'x' * 10**10 }}`` asks for 10 GB, nested loops run 10^10 times. Rendered in the
worker's own process, one such template stops its heartbeat and every tenant's generation.

:func:`render_isolated` renders with ``trainer.chat.render`` in one long-lived child
(``python -m trainer.chat_sandbox``: JSON lines on stdin and stdout), under an address-space
limit (``MEMORY_BYTES``) and a lifetime CPU limit (``CPU_S``, should the worker die
mid-render); a render that takes longer than ``RENDER_S`` seconds or makes
more than ``MAX_CHARS`` characters is a ``ChatTemplateError``, and a child that overran is
killed (the next render starts a new one). Renders are serialized per process (a lock):
each takes milliseconds unless it is one of these.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
import time
from typing import Any

from trainer.chat import ChatTemplateError, render

__all__ = ["MAX_CHARS", "MEMORY_BYTES", "RENDER_S", "render_isolated"]

RENDER_S = 2.0
MAX_CHARS = 4 * 1024 * 1024  # a prompt past this fits no model's context anyway
MEMORY_BYTES = 1 << 30  # the child's address space (RLIMIT_AS)
CPU_S = 600  # the child's CPU over its life (RLIMIT_CPU): past it, a new child


class _Child:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.proc: subprocess.Popen[bytes] | None = None

    def _start(self) -> subprocess.Popen[bytes]:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "trainer.chat_sandbox"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
            )  # in the worker's process group: whatever ends the group ends it too
        return self.proc

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            for pipe in (self.proc.stdin, self.proc.stdout):
                if pipe is not None:
                    pipe.close()
            self.proc = None

    def ask(self, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
        with self.lock:
            proc = self._start()
            assert proc.stdin is not None and proc.stdout is not None
            deadline = time.monotonic() + timeout
            try:
                proc.stdin.write(json.dumps(payload).encode() + b"\n")
                proc.stdin.flush()
                line = _read_line(proc.stdout.fileno(), deadline)
            except (OSError, TimeoutError) as exc:
                self.kill()
                if isinstance(exc, TimeoutError):
                    raise ChatTemplateError(
                        f"the chat template took longer than {timeout:g} s to render"
                    ) from None
                raise ChatTemplateError("the chat template exhausted its renderer") from None
            if line is None:  # the child died (its memory limit, a crash)
                self.kill()
                raise ChatTemplateError("the chat template exhausted its renderer")
            return dict(json.loads(line))


def _read_line(fd: int, deadline: float) -> bytes | None:
    """One line from ``fd`` before ``deadline`` (TimeoutError); None at end of file."""
    data = b""
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise TimeoutError
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return None
        data += chunk
    return data


_CHILD = _Child()
atexit.register(_CHILD.kill)


def render_isolated(
    template: str | None,
    messages: list[dict[str, str]],
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    timeout: float = RENDER_S,
) -> str:
    """``trainer.chat.render`` in the child process, within the module's bounds."""
    reply = _CHILD.ask(
        {
            "template": template,
            "messages": messages,
            "agp": add_generation_prompt,
            "bos": bos_token,
            "eos": eos_token,
        },
        timeout,
    )
    if "error" in reply:
        raise ChatTemplateError(str(reply["error"]))
    return str(reply["text"])


def _serve() -> None:
    """The child: one JSON request a line on stdin, one reply a line on stdout."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    # A backstop should the worker die mid-render: the child's CPU in all is bounded too.
    resource.setrlimit(resource.RLIMIT_CPU, (CPU_S, CPU_S))
    sys.setrecursionlimit(2000)
    for line in sys.stdin.buffer:
        try:
            req = json.loads(line)
            text = render(req["template"], req["messages"], req["agp"], req["bos"], req["eos"])
            if len(text) > MAX_CHARS:
                reply: dict[str, str] = {
                    "error": f"the chat template renders {len(text)} characters, over {MAX_CHARS}"
                }
            else:
                reply = {"text": text}
        except ChatTemplateError as exc:
            reply = {"error": str(exc)}
        except MemoryError:
            reply = {"error": "the chat template needs more memory than a render may use"}
        except Exception as exc:  # a request this child cannot read: still one line
            reply = {"error": f"the chat template failed: {type(exc).__name__}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _serve()
