"""The moe family at the service: a bad expert spec is a 422 naming the field, the dry-run
plan counts active and total parameters as the model has them, and the router's metrics
(the trainer's own record) reach the metrics API and its CSV through Redis and the ingestor."""

from __future__ import annotations

import csv
import io
from typing import Any

import pytest

from tests.api.support import Api
from trainer.events import Publisher

MOE = {
    "family": "moe",
    "n_layer": 2,
    "n_head": 4,
    "d_model": 32,
    "ffn_hidden": 48,
    "seq_len": 32,
    "vocab_size": 256,
    "n_experts": 8,
    "top_k": 2,
}


def _post(api: Api, model: dict[str, Any], dry_run: bool = False) -> Any:
    body = {"name": "moe", "queue": api.queue, "train": {"steps": 5, "model": model}}
    params = {"dry_run": "true"} if dry_run else {}
    return api.client.post("/v1/jobs", json=body, params=params, headers=api.headers())


BAD = [  # (model fields, what the error names)
    ({"top_k": 9}, "top_k (9) must be at most n_experts (8)"),
    ({"n_experts": 0}, "n_experts"),
    ({"aux_loss_coef": -1.0}, "aux_loss_coef"),
    ({"router_z_loss_coef": "0.1"}, "router_z_loss_coef"),
    ({"experts": 4}, "experts"),  # a typo of n_experts: unknown fields are refused
]


def test_bad_expert_spec_is_422_naming_the_field_and_dry_run_counts_active(api: Api) -> None:
    for fields, named in BAD:
        resp = _post(api, {**MOE, **fields})
        assert resp.status_code == 422, resp.text
        errors = resp.json()["detail"]
        assert any(named in e["msg"] or named in map(str, e["loc"]) for e in errors), errors
        assert all(e["loc"][:3] == ["body", "train", "model"] for e in errors), errors
    # (the counts against the model itself: tests/trainer/test_moe.py)
    resp = _post(api, MOE, dry_run=True)
    assert resp.status_code == 200, resp.text
    plan = resp.json()
    assert (
        plan["family"] == "moe" and 0 < plan["parameters"]["active"] < plan["parameters"]["total"]
    )


def test_router_metrics_reach_the_metrics_api(api: Api) -> None:
    from trainer.moe import load_metrics

    job = api.submit()
    url, prefix = api.settings.redis_url, api.settings.redis_prefix
    trainer = Publisher(url, job["id"], 1, "trainer", prefix=prefix)
    # What trainer.train logs: two layers of 4 experts, summed over 2 forwards.
    router = load_metrics([4.2, 0.02, 10, 2, 2, 2, 4, 4, 4, 4], n_experts=4, count=2)
    assert router["expert_load_max"] == pytest.approx(10 / 16)
    try:
        for step in (1, 2):
            trainer.emit("metric", {"step": step, "steps": 2, "loss": 3.0, **router})
        assert trainer.flush(5)
        api.drain(api.ingestor())
    finally:
        trainer.close(2)
    url = f"/v1/jobs/{job['id']}/metrics"
    points = api.client.get(url, headers=api.headers()).json()["points"]
    assert [p["step"] for p in points] == [1, 2]
    for key, value in router.items():
        assert points[-1][key] == pytest.approx(value), key
    text = api.client.get(url, params={"format": "csv"}, headers=api.headers()).text
    rows = list(csv.DictReader(io.StringIO(text)))
    assert float(rows[-1]["expert_load_cv"]) == pytest.approx(router["expert_load_cv"])
