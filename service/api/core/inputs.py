"""What the routes share to read a request: the job id path parameter, body text, JSON objects
whose keys appear once."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Path

from service.api.core.errors import InvalidInput

__all__ = ["JobId", "body_text", "media_type", "no_duplicate_keys"]

JobId = Annotated[str, Path(min_length=1, max_length=32, pattern=r"^[0-9a-f]+$")]


def no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) < len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise InvalidInput.at(["body"], f"key {key!r} is given twice in one object")
            seen.add(key)
    return out


def media_type(content_type: str | None) -> str:
    return (content_type or "application/json").split(";")[0].strip().lower()


def body_text(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidInput.at(["body"], f"body is not UTF-8 (byte offset {exc.start})") from exc
