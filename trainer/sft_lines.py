"""The line-by-line checks of chat and completion JSON Lines (``trainer.sft``'s formats).

Standard library only: the API checks an upload with it as it streams in, and the CLI
before sending it, without numpy or a tokenizer.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

__all__ = [
    "MAX_PROBLEMS",
    "ROLES",
    "SFT_FORMATS",
    "LineError",
    "Problems",
    "check_line",
    "read_lines",
]

SFT_FORMATS = ("chat", "completion")
ROLES = ("system", "user", "assistant")
MAX_PROBLEMS = 5


class LineError(ValueError):
    """One line that is not an example of its format: a reason code and one line of text."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class Problems:
    """Bad lines, counted by reason; the first ``MAX_PROBLEMS`` kept with their numbers."""

    def __init__(self) -> None:
        self.first: list[tuple[int, str]] = []
        self.by_reason: Counter[str] = Counter()

    def add(self, line: int, exc: LineError) -> None:
        self.by_reason[exc.reason] += 1
        if len(self.first) < MAX_PROBLEMS:
            self.first.append((line, str(exc)))

    def __len__(self) -> int:
        return sum(self.by_reason.values())

    def full(self) -> bool:
        return len(self) >= MAX_PROBLEMS

    def summary(self) -> str:
        """``N bad line(s): line 3: ...; line 9: ...`` (the first few)."""
        listed = "; ".join(f"line {n}: {why}" for n, why in self.first)
        more = "" if len(self) <= len(self.first) else f" (and {len(self) - len(self.first)} more)"
        return f"{len(self)} bad line(s): {listed}{more}"


def _text(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise LineError("bad_shape", f"{name} is not a string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # JSON's \ud800: no character, no UTF-8
        raise LineError("not_utf8", f"{name} holds a lone surrogate (not Unicode text)") from None
    return value


def _message(i: int, m: Any) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise LineError("bad_shape", f"{where} is not an object")
    role = m.get("role")
    if role not in ROLES:
        shown = json.dumps(role)[:40]
        raise LineError("unknown_role", f"{where} has role {shown}; roles are {', '.join(ROLES)}")
    content = _text(m.get("content"), f"{where}.content")
    if not content.strip():
        raise LineError("empty_content", f"{where} ({role}) has empty content")
    out: dict[str, Any] = {"role": role, "content": content}
    if "weight" in m:
        weight = m["weight"]
        if role != "assistant" or isinstance(weight, bool) or weight not in (0, 1):
            raise LineError("bad_weight", f"{where}.weight must be 0 or 1, on assistant messages")
        out["weight"] = int(weight)
    return out


def check_line(fmt: str, raw: bytes) -> dict[str, Any] | None:
    """The example on one line, normalized (blank: None); LineError saying what is wrong."""
    if not raw.strip():
        return None
    try:
        record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise LineError("not_utf8", f"is not UTF-8 (byte 0x{raw[exc.start]:02x})") from None
    except ValueError as exc:
        raise LineError("malformed_json", f"is not JSON ({exc})") from None
    except RecursionError:  # [[[[... past the interpreter's depth
        raise LineError("malformed_json", "is JSON nested too deeply") from None
    if fmt == "completion":
        if not isinstance(record, dict):
            raise LineError("bad_shape", 'is not {"prompt": ..., "completion": ...}')
        prompt = _text(record.get("prompt"), "prompt")
        completion = _text(record.get("completion"), "completion")
        if not completion.strip():
            raise LineError("empty_content", "has an empty completion")
        return {"prompt": prompt, "completion": completion}
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise LineError("bad_shape", 'is not {"messages": [...]} with at least one message')
    out = [_message(i, m) for i, m in enumerate(messages)]
    if not any(m["role"] == "assistant" for m in out):
        raise LineError("no_assistant_turn", "has no assistant message to learn from")
    return {"messages": out}


def read_lines(data: bytes, fmt: str) -> Iterator[tuple[int, dict[str, Any] | LineError]]:
    """(line number, example or its LineError) for each non-blank line of ``data``."""
    for n, raw in enumerate(data.split(b"\n"), start=1):
        try:
            example = check_line(fmt, raw)
        except LineError as exc:
            yield n, exc
            continue
        if example is not None:
            yield n, example
