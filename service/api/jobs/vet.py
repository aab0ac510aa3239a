"""Every check a submit makes of a job spec for its owner, in one place.

A job enters the store two ways: ``POST /v1/jobs`` and a sweep's trial (the sweeper). Both,
and a sweep's base and every value its space may give a field, pass through here, so no way
into the jobs table skips a check:

- ``spec_from_payload``: the model (strict types, bounds) and the rules on the spec alone:
  the tenant path rule on every path field (``trainer.paths``), one of ``data.dataset`` /
  ``data.path``, the mesh (``fsdp.replicate``);
- ``vet_spec``: the rules that need the owner and the stores: ``init.job`` names a job the
  owner may see, ``data.dataset`` is the owner's and ready (frozen as its folder), the
  deadline rule, the run folder's size, the owner's priority, the owner's tracking default
  and its outbound URL.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from sqlalchemy import Engine

from service.api.core.auth import Principal
from service.api.core.deps import Services
from service.api.core.errors import InvalidInput
from service.api.core.settings import Settings
from service.api.datasets.service import resolve_dataset
from service.api.jobs import crud
from service.api.jobs.schemas import JobSpec
from service.api.jobs.tracking import check_tracking, needs_check, with_owner_default
from service.api.scheduling.limits import (
    OwnerLimits,
    apply_runtime_rules,
    check_priority,
    check_run_disk,
)
from trainer.config import ConfigError, HFModelConfig, resolve_data_path
from trainer.mesh import LayoutError, layout

__all__ = ["needs_io", "owner_limits", "spec_from_payload", "vet_spec"]


def spec_from_payload(payload: dict[str, Any], data_root: Any) -> JobSpec:
    """A decoded body to a JobSpec checked on its own; InvalidInput names the field."""
    try:
        spec = JobSpec.model_validate(payload)
    except ValidationError as exc:
        raise InvalidInput.of_body("invalid job spec", exc) from exc
    train = spec.train
    if train.data.dataset is None:
        _check_data_path(train.data.path, data_root, ["data", "path"])
    elif "path" in train.data.model_fields_set:
        msg = "give data.dataset (an uploaded dataset) or data.path (a folder), not both"
        raise InvalidInput.at(["body", "train", "data", "dataset"], msg)
    if isinstance(train.model, HFModelConfig):
        _check_data_path(train.model.path, data_root, ["model", "hf", "path"])
    if train.init is not None and train.init.path is not None:
        _check_data_path(train.init.path, data_root, ["init", "path"])
    try:  # fsdp.replicate and expert_parallel divide nodes x procs_per_node (trainer.mesh)
        layout(train, spec.nodes * spec.procs_per_node, spec.nodes)
    except LayoutError as exc:
        raise InvalidInput.at(["body", "train", *exc.field.split(".")], str(exc)) from exc
    return spec


def _check_data_path(path: str, data_root: Any, field: list[str | int]) -> None:
    """A path of the spec (``train.<field>``) is one a tenant may name: the rule of
    ``trainer.paths`` (the shared area of the data root, never ``datasets/``, no link).
    Checked on every submit: the walk is a few ``lstat`` calls, and a cache would let a
    link made a moment ago through."""
    name = "train." + ".".join(str(f) for f in field if f != "hf")
    try:
        resolve_data_path(path, data_root, field=name)
    except ConfigError as exc:
        raise InvalidInput.at(["body", "train", *field], str(exc)) from exc


def owner_limits(services: Services, principal: Principal) -> OwnerLimits:
    """The owner's limits, the settings merged in (cached: a query only on a miss)."""
    if services.limits is None:
        return OwnerLimits.merged(services.settings)
    return services.limits.owners.get(services.reader.connect, principal.name)


def needs_io(spec: JobSpec) -> bool:
    """Whether ``vet_spec`` would read a store, a file or DNS for this spec, the owner's
    default tracking already applied (``with_owner_default``); the submit route then runs
    it on a worker thread, not on the event loop."""
    train = spec.train
    return (
        (train.init is not None and train.init.job is not None)
        or train.data.dataset is not None
        or train.model.family == "hf"  # its shape is read from its config.json
        or needs_check(spec)
    )


def vet_spec(
    settings: Settings,
    reader: Engine,
    principal: Principal,
    spec: JobSpec,
    own: OwnerLimits,
    check_urls: bool = True,
) -> tuple[JobSpec, int]:
    """The spec as it is stored for ``principal`` and its run folder's worst size in bytes;
    InvalidInput (422) or Forbidden (403, priority) naming what is wrong. ``check_urls``
    False skips resolving the tracking URL: for specs that differ from one already checked
    only in fields other than ``train.tracking`` (a sweep's trials)."""
    train = spec.train
    if train.init is not None and train.init.job is not None:
        with reader.connect() as conn:
            if not crud.job_exists(conn, principal, train.init.job):
                raise InvalidInput.at(
                    ["body", "train", "init", "job"],
                    f"job {train.init.job} not found (or not yours)",
                )
    if train.data.dataset is not None:  # frozen as its folder (service.api.datasets.service)
        spec = resolve_dataset(reader, settings.data_root, principal, spec)
    spec = apply_runtime_rules(spec, settings)  # 422, or the queue's default deadline
    disk = check_run_disk(spec, settings)  # 422 over TRAINQ_RUNS_MAX_JOB_BYTES
    check_priority(principal, spec.priority, own)  # 403 above the owner's max_priority
    spec = with_owner_default(spec, own.tracking)  # when the spec names none (or done before)
    if check_urls and needs_check(spec):  # an outbound URL: resolved
        check_tracking(spec, settings)
    return spec, disk
