"""The search space: dotted paths over the job spec, their values, and what Optuna samples.

A path names a field of ``JobSpec`` ("train.optim.lr", "train.batch.micro_batch_size",
"procs_per_node"); a trial's spec is the sweep's base with its values set at those paths,
checked as any submitted spec is, for the sweep's owner (``service.api.jobs.vet``), when the
sweep is made (each value of the space) and again when the trial is. Optuna is imported
here lazily: the API starts without it.
"""

from __future__ import annotations

import copy
import itertools
import types
import typing
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from service.api.core.errors import Forbidden, InvalidInput, first_complaint
from service.api.jobs.schemas import JobSpec
from service.api.sweeps.schemas import Choice, IntRange, Param, Uniform
from trainer.config import drop_replaced

__all__ = ["VARIABLE", "apply", "check_space", "distributions", "grid", "grid_size"]

# The top-level spec fields under which a trial's values may differ: its training, and its
# width (a sweep never varies where it runs, its priority or its deadline).
VARIABLE = ("train", "procs_per_node")


def _models(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models a field's annotation may hold (through Optional, unions, Annotated)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _models(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in _models(arg)]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return []


def _is_field(path: str) -> bool:
    """Whether ``path`` names a leaf or a field of JobSpec (in any member of a union)."""
    models: list[type[BaseModel]] = [JobSpec]
    parts = path.split(".")
    for i, part in enumerate(parts):
        fields = [m.model_fields[part] for m in models if part in m.model_fields]
        if not fields:
            return False
        if i == len(parts) - 1:
            return True
        models = [m for f in fields for m in _models(f.annotation)]
    return False


def apply(base: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """A trial's spec before its checks: the base with each value set at its dotted path
    (missing levels created). A value drops the alternatives it replaces, as ``--set`` does
    (``trainer.config.REPLACES``: a dataset for a data path, a job for an init path); and a
    dataset's folder, frozen in the base, is left out to be resolved again for the trial's
    owner (``service.api.jobs.vet``)."""
    spec = copy.deepcopy(base)
    data = spec.get("train", {}).get("data")
    if isinstance(data, dict) and data.get("dataset") is not None:
        data.pop("path", None)
    for path, value in params.items():
        node = spec
        *parents, leaf = path.split(".")
        for part in parents:
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = {}
            node = child
        node[leaf] = value
        if value is not None:
            drop_replaced(spec, path)
    return spec


def _samples(param: Param) -> list[Any]:
    """The values a check of the space tries: every choice, or both ends of a range."""
    if isinstance(param, Choice):
        return list(param.values)
    return [param.low, param.high]


# The values a sweep's space may ask to be checked at its creation, in all: each is a submit's
# checks (files, queries; DNS for a tracking URL), all in one request.
MAX_SAMPLES = 256


def check_space(
    base: dict[str, Any], space: dict[str, Param], vet: Callable[[dict[str, Any], str], object]
) -> None:
    """InvalidInput naming ``space.<path>`` for a path that is no spec field, a range that is
    empty, or a value that makes a spec its owner may not submit: each value tried (every
    choice, both ends of a range) goes through ``vet(spec, path)``, every check a submit
    makes; at most ``MAX_SAMPLES`` of them (a 422 naming ``space``)."""
    samples = sum(len(_samples(param)) for param in space.values())
    if samples > MAX_SAMPLES:
        raise InvalidInput.at(
            ["body", "space"],
            f"the space has {samples} values to check (each choice, both ends of each range);"
            f" at most {MAX_SAMPLES}",
        )
    for path, param in space.items():
        where: list[str | int] = ["body", "space", path]
        if not _is_field(path) or path.split(".")[0] not in VARIABLE:
            raise InvalidInput.at(
                where,
                f"{path!r} is not a field of the job spec a trial may vary"
                f" ({', '.join(VARIABLE)}; e.g. train.optim.lr)",
            )
        if isinstance(param, Uniform | IntRange) and not param.low < param.high:
            raise InvalidInput.at(where, "low must be below high")
        log_scale = isinstance(param, Uniform) and param.type == "loguniform"
        log_scale = log_scale or (isinstance(param, IntRange) and param.log)
        if log_scale and not isinstance(param, Choice) and param.low <= 0:
            raise InvalidInput.at(where, "a log scale needs low > 0")
        for value in _samples(param):
            try:
                vet(apply(base, {path: value}), path)
            except (InvalidInput, Forbidden) as exc:
                raise InvalidInput.at(
                    where,
                    f"the value {value!r} makes a spec that cannot be submitted:"
                    f" {first_complaint(exc)}",
                ) from exc


def distributions(space: dict[str, Any]) -> dict[str, Any]:
    """Optuna's distribution of each path (``space`` as stored: plain JSON)."""
    import optuna.distributions as od

    out: dict[str, Any] = {}
    for path, p in space.items():
        if p["type"] == "choice":
            out[path] = od.CategoricalDistribution(p["values"])
        elif p["type"] == "int":
            step, log = p.get("step", 1), p.get("log", False)
            out[path] = od.IntDistribution(p["low"], p["high"], step=step, log=log)
        else:
            out[path] = od.FloatDistribution(p["low"], p["high"], log=p["type"] == "loguniform")
    return out


def _grid_values(p: dict[str, Any]) -> list[Any]:
    if p["type"] == "choice":
        return list(p["values"])
    if p["type"] == "int" and not p.get("log", False):
        return list(range(p["low"], p["high"] + 1, p.get("step", 1)))
    return []  # a continuous range has no grid


def grid_size(space: dict[str, Any]) -> int:
    """The number of points of the grid (0: the space has a continuous range)."""
    size = 1
    for p in space.values():
        size *= len(_grid_values(p))
    return size


def grid(space: dict[str, Any], number: int) -> dict[str, Any]:
    """The ``number``-th point of the grid, in the order the space lists its values (the
    last path varies fastest), so a grid sweep's trials are the ones a user would write."""
    values = [_grid_values(p) for p in space.values()]
    point = next(itertools.islice(itertools.product(*values), number, None))
    return dict(zip(space, point, strict=True))
