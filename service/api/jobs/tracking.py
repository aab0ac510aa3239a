"""A submit's check of ``train.tracking``: a tracking URI is an outbound URL (trainer.outbound).

Its address must be a public one unless the admin allows private ones
(TRAINQ_TRACKING_ALLOW_PRIVATE); a metadata address never. The name is resolved here, on a
worker thread (a slow resolver holds no event loop), and again by the trainer before it
connects, with the worker's own setting.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from pydantic import ValidationError

from service.api.core.errors import InvalidInput
from trainer.config import TrackingConfig
from trainer.outbound import OutboundRefused, check_url, pinned_addresses

if TYPE_CHECKING:
    from service.api.core.settings import Settings
    from service.api.jobs.schemas import JobSpec

__all__ = ["check_tracking", "needs_check", "with_owner_default"]

_FIELD = "train.tracking.mlflow.tracking_uri"


def with_owner_default(spec: JobSpec, default: str | None) -> JobSpec:
    """The spec with its owner's default ``train.tracking`` (``trainq token tracking``;
    ``default`` as JSON text) when it names none; ``tracking: {}`` opts out of it."""
    if spec.train.tracking is not None or default is None:
        return spec
    try:
        tracking = TrackingConfig.model_validate(json.loads(default))
    except (ValueError, ValidationError) as exc:  # set before a rule it now breaks
        raise InvalidInput.at(
            ["body", "train", "tracking"],
            f"this owner's default train.tracking (trainq token tracking) is no longer valid:"
            f" {exc}; give train.tracking in the spec ({{}} for none)",
        ) from None
    return spec.model_copy(update={"train": spec.train.model_copy(update={"tracking": tracking})})


def needs_check(spec: JobSpec) -> bool:
    tracking = spec.train.tracking
    return tracking is not None and tracking.mlflow is not None


def check_tracking(spec: JobSpec, settings: Settings) -> None:
    """InvalidInput naming the tracking URI when trainq may not connect to it."""
    tracking = spec.train.tracking
    if tracking is None or tracking.mlflow is None:
        return
    allow = settings.tracking_allow_private
    try:
        parts = check_url(tracking.mlflow.tracking_uri, allow_private=allow)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        pinned_addresses(parts.hostname or "", port, allow_private=allow)
    except OutboundRefused as exc:
        hint = "" if allow else " (an admin allows private ones: TRAINQ_TRACKING_ALLOW_PRIVATE=1)"
        raise InvalidInput.at(
            ["body", "train", "tracking", "mlflow", "tracking_uri"], f"{_FIELD}: {exc}{hint}"
        ) from None
