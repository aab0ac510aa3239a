"""Field types every domain's schemas share: UTC datetimes and text without control characters."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Annotated

from pydantic import AfterValidator

from trainer.config import reject_nul

__all__ = ["Text", "UTCDatetime", "reject_control"]


def _utc(value: datetime) -> datetime:
    # SQLite returns naive datetimes; everything the service stores is UTC.
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


UTCDatetime = Annotated[datetime, AfterValidator(_utc)]
# C0 and C1 controls, DEL, line/paragraph separators and bidi overrides: a name or label
# with one can rewrite a terminal row or forge a line in `trainq ls`.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def reject_control(value: str) -> str:
    reject_nul(value)
    found = _CONTROL.search(value)
    if found:
        raise ValueError(
            f"must not contain control characters (U+{ord(found.group()):04X} at {found.start()})"
        )
    return value


Text = Annotated[str, AfterValidator(reject_control)]
