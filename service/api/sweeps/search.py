"""The searcher: an Optuna study per sweep, driven through ask/tell, kept in the sweep's row.

The study (its sampler's random state, its trials with their values, the pruner's rungs) is
pickled into ``sweeps.study`` in the transaction that makes the trials it proposed, so a
proposal is never made twice nor lost: a pass that dies before its commit leaves the study as
it was, and the next pass asks the same question again and gets the same answer. The blob is
written and read only by the service (never from a request), like any other column.
Optuna is imported lazily: the API starts without loading it.
"""

from __future__ import annotations

import pickle
from typing import Any

__all__ = ["dump", "load", "new_study"]


def new_study(method: str, goal: str, seed: int | None, early_stop: dict[str, Any] | None) -> Any:
    """An in-memory study: grid and random draw with RandomSampler (grid points are enqueued
    in order), tpe with TPESampler; the pruner of ``early_stop`` (none without)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler: Any
    if method == "tpe":
        sampler = optuna.samplers.TPESampler(seed=seed)
    else:
        sampler = optuna.samplers.RandomSampler(seed=seed)
    pruner: Any = optuna.pruners.NopPruner()
    if early_stop is not None and early_stop["method"] == "asha":
        pruner = optuna.pruners.SuccessiveHalvingPruner(
            min_resource=early_stop["min_steps"],
            reduction_factor=early_stop["reduction_factor"],
            min_early_stopping_rate=0,
        )
    elif early_stop is not None:
        pruner = optuna.pruners.MedianPruner(
            n_startup_trials=early_stop["startup_trials"], n_warmup_steps=early_stop["min_steps"]
        )
    direction = optuna.study.StudyDirection.MINIMIZE
    if goal == "max":
        direction = optuna.study.StudyDirection.MAXIMIZE
    return optuna.create_study(sampler=sampler, pruner=pruner, direction=direction)


def dump(study: Any) -> bytes:
    return pickle.dumps(study, protocol=pickle.HIGHEST_PROTOCOL)


def load(blob: bytes) -> Any:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return pickle.loads(blob)  # the service's own column, never a request's
