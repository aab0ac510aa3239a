"""Sweeps in the service (service.api.sweeps): validation, proposals, pruning, restarts.

The sweeper's passes, the ingestor and the trials' workers are driven by hand here (the
workers simulated on the real Redis wire: tests.api.support.WorkerSim), so each step is
deterministic; tests/e2e/test_sweeps_system.py runs sweeps on real workers.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import text
from typer.testing import CliRunner

from service.api.jobs import crud, room
from service.api.jobs.schemas import JobSpec
from service.api.scheduling.limits import check_run_disk
from service.api.sweeps.sweeper import Sweeper
from service.cli import main as cli
from tests.api.support import Api, Uvicorn, WorkerSim

TRAIN = {"steps": 8, "eval": {"every": 0}, "model": {"n_layer": 1, "d_model": 16, "n_head": 2}}


def _body(api: Api, **over: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "name": "s",
        "base": {"queue": api.queue, "train": TRAIN},
        "space": {"train.optim.lr": {"type": "loguniform", "low": 1e-5, "high": 1e-1}},
        "method": "random",
        "metric": "loss",
        "budget": 4,
        "parallelism": 2,
        "seed": 3,
    }
    return {**body, **over}


def _post(api: Api, body: dict[str, Any]) -> Any:
    return api.client.post("/v1/sweeps", json=body, headers=api.headers())


def _sweep(api: Api, sweep_id: str) -> dict[str, Any]:
    resp = api.client.get(f"/v1/sweeps/{sweep_id}", headers=api.headers())
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def _sweeper(api: Api) -> Sweeper:
    """A sweeper as a freshly started API process has one: nothing in memory."""
    s = api.services
    return Sweeper(s.settings, s.sessions, s.redis, s.dispatcher)


def _run(api: Api, sim: Callable[..., WorkerSim], job_id: str, losses: list[float]) -> WorkerSim:
    w = sim(job_id)
    w.claim()
    w.running()
    for step, loss in enumerate(losses, 1):
        w.metric(step, steps=len(losses), loss=loss)
    api.drain()
    return w


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"space": {"train.optim.learning_rate": {"type": "choice", "values": [1]}}}, "space"),
        ({"space": {"queue": {"type": "choice", "values": ["a"]}}}, "space"),
        ({"space": {"train.optim.lr": {"type": "choice", "values": [20.0]}}}, "space"),
        ({"space": {"train.steps": {"type": "uniform", "low": 1.0, "high": 5.0}}}, "space"),
        ({"space": {"train.optim.lr": {"type": "loguniform", "low": 0.0, "high": 1.0}}}, "space"),
        ({"space": {"train.optim.lr": {"type": "normal"}}}, "space"),
        ({"base": {"queue": "q", "train": {"stepz": 3}}}, "base"),
        ({"base": {"queue": "q", "train": {"data": {"path": "../etc"}}}}, "base"),
        ({"metric": "accuracy"}, "metric"),
        ({"metric": "val_loss"}, "metric"),  # the base never evaluates
        ({"method": "grid"}, "method"),  # a continuous range has no grid
        ({"budget": 0}, "budget"),
        (  # 3 x 100 values, each a submit's checks in the one request: past the 256
            {
                "space": {
                    f"train.{p}": {"type": "choice", "values": [0.5 + i / 1000 for i in range(100)]}
                    for p in ("optim.lr", "optim.weight_decay", "optim.grad_clip")
                }
            },
            "space",
        ),
        ({"parallelism": 10_000}, "parallelism"),
        ({"goal": "lowest"}, "goal"),
        ({"early_stop": {"method": "hyperband"}}, "early_stop"),
    ],
)
def test_a_bad_sweep_is_a_422_naming_its_field(
    api: Api, change: dict[str, Any], field: str
) -> None:
    resp = _post(api, {**_body(api), **change})
    assert resp.status_code == 422, resp.text
    locs = [e["loc"] for e in resp.json()["detail"]]
    assert any(loc[:2] == ["body", field] for loc in locs), locs
    listed = api.client.get("/v1/sweeps", headers=api.headers()).json()["items"]
    assert listed == []  # nothing stored


def test_a_seeded_sweep_proposes_the_same_trials_and_a_restart_none_twice(
    api: Api, sim: Callable[..., WorkerSim]
) -> None:
    first = _post(api, _body(api)).json()["id"]
    second = _post(api, _body(api)).json()["id"]
    other_seed = _post(api, _body(api, seed=4)).json()["id"]
    seen: dict[str, list[Any]] = {}
    for sweep_id in (first, second, other_seed):
        for round_ in range(3):  # parallelism 2, budget 4: two rounds of trials, then the end
            _sweeper(api).run_once()
            _sweeper(api).run_once()  # a restarted process's pass: nothing more proposed
            sweep = _sweep(api, sweep_id)
            live = [t for t in sweep["trials"] if t["status"] == "queued"]
            assert len(live) == (2 if round_ < 2 else 0), sweep
            for t in live:
                w = _run(api, sim, t["job_id"], [3.0, 2.0 + t["params"]["train.optim.lr"]])
                w.exited(0)
            api.drain()
        sweep = _sweep(api, sweep_id)
        assert sweep["status"] == "finished" and sweep["proposed"] == 4
        seen[sweep_id] = [t["params"]["train.optim.lr"] for t in sweep["trials"]]
        assert len(set(seen[sweep_id])) == 4  # no trial proposed twice
        job = api.get(sweep["trials"][0]["job_id"])
        assert job["sweep"] == sweep_id and job["params"] == sweep["trials"][0]["params"]
        assert job["train"]["optim"]["lr"] == sweep["trials"][0]["params"]["train.optim.lr"]
    assert seen[first] == seen[second]
    assert seen[first] != seen[other_seed]
    best = _sweep(api, first)["best_trial"]
    assert best["params"]["train.optim.lr"] == min(seen[first])  # the loss grows with lr here


def test_a_grid_sweep_walks_the_grid_in_order(api: Api) -> None:
    space = {
        "train.optim.lr": {"type": "choice", "values": [0.1, 0.01]},
        "train.batch.micro_batch_size": {"type": "int", "low": 1, "high": 3},
    }
    body = _body(api, method="grid", space=space, budget=100, parallelism=10)
    sweep_id = _post(api, body).json()["id"]
    _sweeper(api).run_once()
    sweep = _sweep(api, sweep_id)
    got = [
        (t["params"]["train.optim.lr"], t["params"]["train.batch.micro_batch_size"])
        for t in sweep["trials"]
    ]
    assert got == [(lr, b) for lr in (0.1, 0.01) for b in (1, 2, 3)]


def test_a_trials_best_is_its_best_point_and_the_sweeps_best_its_last(
    api: Api, sim: Callable[..., WorkerSim]
) -> None:
    space = {"train.optim.lr": {"type": "choice", "values": [0.1, 0.01]}}
    sweep_id = _post(api, _body(api, method="grid", space=space, budget=2)).json()["id"]
    _sweeper(api).run_once()
    first, second = _sweep(api, sweep_id)["trials"]
    _run(api, sim, first["job_id"], [3.0, 1.5, 2.5]).exited(0)
    _run(api, sim, second["job_id"], [3.0, 2.0, 2.2]).exited(0)
    api.drain()
    _sweeper(api).run_once()
    sweep = _sweep(api, sweep_id)
    assert [(t["best"], t["value"]) for t in sweep["trials"]] == [(1.5, 2.5), (2.0, 2.2)]
    assert sweep["best_trial"]["job_id"] == second["job_id"]  # Optuna is told the last value


def test_asha_stops_the_hopeless_trials_which_end_stopped_early_with_no_retry_spent(
    api: Api, sim: Callable[..., WorkerSim]
) -> None:
    lrs = [1e-2, 1e-4, 1e-1, 1e-3]  # trial 0 second best: the first to reach a rung
    body = _body(
        api,
        method="grid",
        space={"train.optim.lr": {"type": "choice", "values": lrs}},
        parallelism=4,
        early_stop={"method": "asha", "min_steps": 2, "reduction_factor": 2},
        base={"queue": api.queue, "retries": 2, "train": TRAIN},
    )
    sweep_id = _post(api, body).json()["id"]
    _sweeper(api).run_once()
    trials = _sweep(api, sweep_id)["trials"]
    workers = {}
    for t in trials:  # the loss falls faster with a larger lr
        lr = t["params"]["train.optim.lr"]
        workers[t["job_id"]] = _run(
            api, sim, t["job_id"], [5.0 + s / math.log10(lr) for s in range(1, 5)]
        )
        _sweeper(api).run_once()  # each trial reports, then the pruner looks
    after = {t["job_id"]: t for t in _sweep(api, sweep_id)["trials"]}
    stopping = [j for j, t in after.items() if t["status"] == "cancelling"]
    assert len(stopping) >= 2, after
    worst = sorted(after, key=lambda j: after[j]["params"]["train.optim.lr"])[:2]
    assert set(worst) <= set(stopping)
    for job_id in stopping:  # the worker's cancel: SIGTERM, a checkpoint, the exit
        assert api.services.redis.get(api.keys.cancel(job_id)) is not None
        workers[job_id].exited(None, "cancelled", "cancelled by the user")
    for job_id in set(after) - set(stopping):
        workers[job_id].exited(0)
    api.drain()
    _sweeper(api).run_once()
    sweep = _sweep(api, sweep_id)
    for job_id in stopping:
        job = api.get(job_id)
        assert job["status"] == "stopped_early" and job["retries_used"] == 0
        assert len(job["attempts"]) == 1
    assert sweep["status"] == "finished"
    assert sweep["best_trial"]["params"]["train.optim.lr"] == max(lrs)


def test_cancel_a_sweep_cancels_its_trials(api: Api) -> None:
    sweep_id = _post(api, _body(api)).json()["id"]
    _sweeper(api).run_once()
    resp = api.client.post(f"/v1/sweeps/{sweep_id}/cancel", headers=api.headers())
    assert resp.status_code == 200, resp.text
    sweep = resp.json()
    assert sweep["status"] == "cancelled"
    assert [t["status"] for t in sweep["trials"]] == ["cancelled", "cancelled"]
    _sweeper(api).run_once()
    assert len(_sweep(api, sweep_id)["trials"]) == 2  # nothing proposed after the cancel
    other = api.client.get(f"/v1/sweeps/{sweep_id}", headers=api.headers(api.other_token))
    assert other.status_code == 404


def test_trials_wait_for_the_owners_limits_and_the_sweep_says_why(api: Api) -> None:
    s = api.services

    def sweeper(**settings: Any) -> Sweeper:
        return Sweeper(s.settings.model_copy(update=settings), s.sessions, s.redis, s.dispatcher)

    sweep_id = _post(api, _body(api)).json()["id"]  # parallelism 2
    sweeper(max_queued_per_owner=1).run_once()
    sweep = _sweep(api, sweep_id)
    assert [t["number"] for t in sweep["trials"]] == [0] and sweep["proposed"] == 1
    assert sweep["status"] == "running" and "waits" in sweep["message"], sweep["message"]
    assert "queued" in sweep["message"]

    disk = check_run_disk(JobSpec.model_validate(_body(api)["base"]), s.settings)
    assert disk > 0
    sweeper(runs_max_owner_bytes=disk * 3 // 2).run_once()  # room for one trial's run only
    sweep = _sweep(api, sweep_id)
    assert [t["number"] for t in sweep["trials"]] == [0] and sweep["proposed"] == 1
    assert "TRAINQ_RUNS_MAX_OWNER_BYTES" in sweep["message"]

    sweeper().run_once()  # the limits lifted: the trial that waited is proposed, no other
    sweep = _sweep(api, sweep_id)
    assert [t["number"] for t in sweep["trials"]] == [0, 1] and sweep["message"] is None
    twin = _post(api, _body(api)).json()["id"]  # the same seed, never held back
    sweeper().run_once()
    assert [t["params"] for t in _sweep(api, twin)["trials"]] == [
        t["params"] for t in sweep["trials"]
    ]


def test_a_trial_refused_room_takes_back_the_trials_asked_after_it(api: Api) -> None:
    """A pass asks for and checks every trial first, then counts them against the room:
    the trial that does not fit is taken back with every trial asked after it."""
    s = api.services

    def sweeper(**settings: Any) -> Sweeper:
        return Sweeper(s.settings.model_copy(update=settings), s.sessions, s.redis, s.dispatcher)

    body = _body(api, parallelism=3, budget=5)
    sweep_id = _post(api, body).json()["id"]
    disk = check_run_disk(JobSpec.model_validate(body["base"]), s.settings)
    sweeper(runs_max_owner_bytes=disk * 3 // 2).run_once()  # 3 asked, room for one
    sweep = _sweep(api, sweep_id)
    assert [t["number"] for t in sweep["trials"]] == [0] and sweep["proposed"] == 1
    assert "TRAINQ_RUNS_MAX_OWNER_BYTES" in sweep["message"]
    sweeper().run_once()
    sweep = _sweep(api, sweep_id)
    assert [t["number"] for t in sweep["trials"]] == [0, 1, 2] and sweep["proposed"] == 3
    twin = _post(api, body).json()["id"]  # the same seed, never held back
    sweeper().run_once()
    assert [t["params"] for t in _sweep(api, twin)["trials"]] == [
        t["params"] for t in sweep["trials"]
    ]


def test_a_trial_waits_for_a_submit_holding_its_owners_room(api: Api) -> None:
    """The race the owner's lock closes: a submit of the owner under the bound is between
    its count and its commit when the sweeper comes to count a trial. The trial waits for
    the lock, then counts the submit's run and is held back (PostgreSQL row lock)."""
    s = api.services
    body = _body(api, parallelism=1, budget=1)
    sweep_id = _post(api, body).json()["id"]
    spec = JobSpec.model_validate(body["base"])
    disk = check_run_disk(spec, s.settings)
    bound = disk * 3 // 2  # room for one run
    principal = s.tokens.resolve(f"Bearer {api.token}")
    sweeper = Sweeper(
        s.settings.model_copy(update={"runs_max_owner_bytes": bound}),
        s.sessions, s.redis, s.dispatcher,
    )  # fmt: skip
    passed: list[Any] = []
    with s.sessions() as submit, submit.begin():  # a submit, stopped before its commit
        room.lock(submit, api.user)
        room.check(submit, api.user, disk, bound)
        crud.insert_job(submit, crud.job_row(principal, spec, None, disk))
        thread = threading.Thread(target=lambda: passed.append(sweeper.run_once()))
        thread.start()
        deadline = time.monotonic() + 10
        with s.sessions() as look:
            while not look.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND wait_event_type = 'Lock' AND query LIKE '%job_owners%'"
                )
            ).scalar():
                assert time.monotonic() < deadline, "the sweeper never waited for the lock"
                assert thread.is_alive(), "the sweeper's pass ended without waiting"
                time.sleep(0.02)
                look.rollback()
    thread.join(timeout=30)
    assert len(passed) == 1  # the pass ended (other tests' sweeps may have made trials)
    sweep = _sweep(api, sweep_id)
    assert sweep["trials"] == [] and "TRAINQ_RUNS_MAX_OWNER_BYTES" in sweep["message"]
    with s.sessions() as session:
        assert room.used(session, api.user) == disk <= bound


def test_trainq_sweep_list(api: Api) -> None:
    first = _post(api, _body(api, name="lr-a")).json()["id"]
    second = _post(api, _body(api, name="lr-b", budget=3)).json()["id"]
    _sweeper(api).run_once()
    with Uvicorn(api.app) as server:
        env = {"TRAINQ_URL": server.url, "TRAINQ_TOKEN": api.token}
        listed = CliRunner().invoke(cli.app, ["sweep", "list"], env=env, catch_exceptions=False)
        assert listed.exit_code == 0, listed.stderr
        lines = listed.stdout.splitlines()
        assert lines[0].split() == [
            "ID", "NAME", "STATUS", "METHOD", "TRIALS", "METRIC", "BEST", "CREATED",
        ]  # fmt: skip
        assert [line.split()[:5] for line in lines[1:]] == [
            [second, "lr-b", "running", "random", "2/3"],
            [first, "lr-a", "running", "random", "2/4"],
        ]
        env["TRAINQ_TOKEN"] = api.other_token
        none = CliRunner().invoke(cli.app, ["sweep", "list"], env=env, catch_exceptions=False)
        assert none.exit_code == 0 and none.stdout.strip() == "no sweeps"
