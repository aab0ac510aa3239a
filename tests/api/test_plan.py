"""``POST /v1/jobs?dry_run=true``: the spec validated as a submit is, answered with its plan
(trainer.plan), with nothing stored and nothing sent."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib

from tests.api.support import Api

TINY = {"n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 32, "vocab_size": 256}


def _body(api: Api, **train: Any) -> dict[str, Any]:
    return {"name": "plan", "queue": api.queue, "train": {"model": TINY, **train}}


def _plan(api: Api, body: dict[str, Any], **headers: str) -> dict[str, Any]:
    resp = api.client.post(
        "/v1/jobs", params={"dry_run": "true"}, json=body, headers={**api.headers(), **headers}
    )
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def _broker_len(api: Api) -> int:
    broker = redis_lib.Redis.from_url(api.settings.broker_url)
    try:
        return int(broker.llen(api.broker_queue))
    finally:
        broker.close()


def _my_jobs(api: Api) -> list[dict[str, Any]]:
    resp = api.client.get("/v1/jobs", headers=api.headers())
    return [j for j in resp.json()["items"] if j["queue"] == api.queue]


def _register(api: Api, name: str, gpus: list[int], **extra: Any) -> None:
    # A registry entry as worker/registry.py writes it (plus ``extra``), straight into the
    # hash the API reads, as tests.api.support.register_worker does.
    info = {"name": name, "host": "h1", "queues": [api.queue], "slots": 2, "gpus": gpus}
    info |= {"running": [], "ts": time.time(), **extra}
    api.services.redis.hset(api.keys.workers, name, json.dumps(info))
    api.services._workers = (0.0, [])  # drop the one-second cache


def test_dry_run_answers_the_plan_and_stores_and_sends_nothing(api: Api) -> None:
    body = {**_body(api, batch={"micro_batch_size": 4, "grad_accum_steps": 3}), "nodes": 2}
    body["procs_per_node"] = 2
    out = _plan(api, body, **{"Idempotency-Key": "plan-key"})

    # GPT: per block 12d^2 + 13d (qkv, proj, fc, proj with biases, two LayerNorms); outside
    # the blocks the token and position embeddings and ln_f (the head is tied).
    d = 32
    total = 2 * (12 * d * d + 13 * d) + 256 * d + 32 * d + 2 * d
    assert out["parameters"] == {"total": total, "trainable": total, "active": total}
    assert out["family"] == "gpt" and out["world_size"] == 4
    assert out["tokens_per_step"] == 4 * 3 * 32 * 4
    device = out["memory"]["device"]
    # Three micro-batches: the gradients of the first two are there at the third's peak.
    resident = ("weights", "gathered", "gradients", "optimizer")
    transient = max(device["activations"], device["optimizer_step"])
    assert device["total"] == sum(device[k] for k in resident) + transient
    # One micro-batch: backward peaks before it has made any gradient (DDP's buckets aside).
    body_one = {**body, "train": {**body["train"], "batch": {"micro_batch_size": 4}}}
    one = _plan(api, body_one)["memory"]["device"]
    assert one == {**device, "total": device["total"] - 4 * total}
    assert out["memory"]["host"]["total"] == 0  # nothing offloaded
    assert out["fits"] is None and out["fits_reason"] == f"no worker serves queue {api.queue}"

    assert _my_jobs(api) == [] and _broker_len(api) == 0
    # The key was not taken either: a real submit with it and another spec is a new job.
    real = api.client.post(
        "/v1/jobs",
        json={**body, "name": "real"},
        headers={**api.headers(), "Idempotency-Key": "plan-key"},
    )
    assert real.status_code == 201, real.text
    assert len(_my_jobs(api)) == 1 and _broker_len(api) == 2  # a message per node


BAD = [
    {"train": {"model": {**TINY, "n_head": 3}}},  # d_model not divisible
    {"train": {"steps": "5"}},  # strict types
    {"train": {"stepz": 5}},  # unknown field
    {"train": {"data": {"path": "../../etc"}}},  # outside the data root
    {"train": {"precision": "fp16", "strategy": "fsdp"}},
    {"train": {"init": {"job": "ab12"}}},  # no such job of the caller's
    {"procs_per_node": 1000, "train": {}},
    {"nodes": 2, "train": {"strategy": "fsdp", "fsdp": {"replicate": 3}}},  # 3 of 2 ranks
    [1, 2],
]


@pytest.mark.parametrize("body", BAD)
def test_bad_specs_get_the_same_answer_as_a_submit(api: Api, body: Any) -> None:
    if isinstance(body, dict):
        body = {"queue": api.queue, **body}
    answers = [
        api.client.post("/v1/jobs", params=params, json=body, headers=api.headers())
        for params in ({"dry_run": "true"}, {})
    ]
    dry, real = answers
    assert dry.status_code == real.status_code == 422, (dry.text, real.text)
    assert dry.json() == real.json()
    assert _my_jobs(api) == [] and _broker_len(api) == 0


def test_bad_yaml_and_json_bodies_get_the_same_answer(api: Api) -> None:
    for raw, media in (("a: &x 1\nb: *x", "application/yaml"), ("{nope", "application/json")):
        dry, real = (
            api.client.post(
                "/v1/jobs",
                params=params,
                content=raw,
                headers={**api.headers(), "Content-Type": media},
            )
            for params in ({"dry_run": "true"}, {})
        )
        assert dry.status_code == real.status_code == 422 and dry.json() == real.json()


def test_activation_checkpointing_lowers_the_estimate(api: Api) -> None:
    got = {
        ac: _plan(api, _body(api, activation_checkpointing=ac))["memory"]["device"]
        for ac in ("none", "selective", "full")
    }
    acts = [got[ac]["activations"] for ac in ("none", "selective", "full")]
    assert acts[0] > acts[1] > acts[2] > 0
    totals = [got[ac]["total"] for ac in ("none", "selective", "full")]
    assert totals[0] > totals[1] > totals[2]
    for ac in ("selective", "full"):  # only the activations change
        assert got[ac]["weights"] == got["none"]["weights"]
        assert got[ac]["optimizer"] == got["none"]["optimizer"]


def test_fsdp_shards_what_ddp_replicates(api: Api) -> None:
    def device(procs: int, **train: Any) -> dict[str, int]:
        # four blocks: resharding keeps two gathered at a time (the next one prefetched)
        body = {**_body(api, **train), "procs_per_node": procs}
        body["train"]["model"] = {**TINY, "n_layer": 4}
        return dict(_plan(api, body)["memory"]["device"])

    ddp = device(4)
    fsdp = device(4, strategy="fsdp")
    wider = device(8, strategy="fsdp")
    for term in ("weights", "optimizer"):
        assert ddp[term] > fsdp[term] > wider[term] > 0
    assert ddp["gathered"] == 0 and fsdp["gathered"] > 0
    assert fsdp["activations"] == ddp["activations"]  # data parallel: same micro-batch
    assert (
        device(4, strategy="fsdp", fsdp={"reshard_after_forward": False})["gathered"]
        > (fsdp["gathered"])
    )
    bf16 = device(4, strategy="fsdp", precision="bf16")
    assert bf16["weights"] == fsdp["weights"]  # fp32 master shards either way
    assert bf16["gathered"] < fsdp["gathered"]  # gathered in bf16

    body = {**_body(api, strategy="fsdp", fsdp={"cpu_offload": True}), "procs_per_node": 4}
    body["train"]["model"] = {**TINY, "n_layer": 4}
    offload = _plan(api, body)["memory"]
    assert offload["device"]["weights"] == offload["device"]["optimizer"] == 0
    assert offload["device"]["total"] < fsdp["total"]
    assert offload["host"]["weights"] == fsdp["weights"]
    assert offload["host"]["optimizer"] == fsdp["optimizer"]
    assert offload["host_per_node"] == 4 * offload["host"]["total"]


def test_lora_trains_only_the_adapters(api: Api) -> None:
    rank, d = 4, 32
    full = _plan(api, _body(api))["parameters"]["total"]
    # gpt's default targets, the attention projections: qkv (d -> 3d) and proj (d -> d).
    gpt = _plan(api, _body(api, lora={"rank": rank}))
    adapters = 2 * (rank * (d + 3 * d) + rank * (d + d))
    assert gpt["parameters"] == {
        "total": full + adapters,
        "trainable": adapters,
        "active": full + adapters,
    }
    plain = _plan(api, _body(api))["memory"]["device"]
    lora = gpt["memory"]["device"]
    assert lora["optimizer"] == 8 * adapters < plain["optimizer"]
    assert lora["activations"] < plain["activations"]  # the frozen MLP keeps no inputs

    # llama with GQA (2 kv heads of 8 dims) and named targets: wk (d -> 16) and w2 (h -> d),
    # h = 8/3 * d rounded up to 32: 96.
    model = {"family": "llama", "n_layer": 3, "n_head": 4, "n_kv_head": 2, "d_model": d}
    body: dict[str, Any] = {"name": "p", "queue": api.queue, "train": {"model": model}}
    body["train"]["lora"] = {"rank": rank, "targets": ["wk", "w2"]}
    llama = _plan(api, body)["parameters"]
    assert llama["trainable"] == 3 * (rank * (d + 16) + rank * (96 + d))

    body["train"]["lora"] = {"rank": rank, "targets": ["nothing_has_this_name"]}
    none = _plan(api, body)
    assert none["parameters"]["trainable"] == 0 and "match no linear" in " ".join(none["notes"])


def test_fits_against_the_devices_of_the_queue(api: Api) -> None:
    _register(api, "w-nomem", [0, 1])
    out = _plan(api, _body(api))
    assert out["fits"] is None
    assert out["fits_reason"] == "the queue's workers do not report device memory"

    # A GPU worker's entry with ``gpu_memory_bytes`` (one per GPU, from nvidia-smi:
    # worker/registry.py, tests/worker/test_registry.py).
    api.services.redis.hdel(api.keys.workers, "w-nomem")
    _register(api, "w-big", [0, 1], gpu_memory_bytes=[80 << 30, 80 << 30])
    out = _plan(api, _body(api))
    assert out["fits"] is True and out["device_memory_bytes"] == 80 << 30
    _register(api, "w-small", [0], gpu_memory_bytes=[1 << 20])  # the smallest decides
    out = _plan(api, _body(api))
    assert out["fits"] is False and out["device_memory_bytes"] == 1 << 20
    assert "exceeds" in out["fits_reason"]


def test_hf_reads_config_json_under_the_data_root(api: Api, data_root: Path) -> None:
    folder = f"hf-{uuid.uuid4().hex[:8]}"
    (data_root / folder).mkdir()
    d, layers, vocab, hidden = 64, 2, 300, 96
    config = {
        "model_type": "llama",
        "hidden_size": d,
        "intermediate_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": vocab,
        "tie_word_embeddings": False,
    }
    (data_root / folder / "config.json").write_text(json.dumps(config))
    model = {"family": "hf", "path": folder, "seq_len": 32}
    out = _plan(api, {"queue": api.queue, "train": {"model": model}})
    # q, o: d x d; k, v: d x 32 (2 heads of 16); gate, up, down: d x hidden; two RMSNorms.
    block = 2 * d * d + 2 * d * 32 + 3 * d * hidden + 2 * d
    assert out["parameters"]["total"] == layers * block + 2 * vocab * d + d
    assert out["memory"]["device"]["total"] > 0 and out["notes"] == []

    model["path"] = f"{folder}-missing"
    out = _plan(api, {"queue": api.queue, "train": {"model": model}})
    assert out["parameters"] == {"total": None, "trainable": None, "active": None}
    assert out["memory"] is None
    assert out["fits"] is None and "config.json" in out["notes"][0]


def test_the_plan_loads_no_torch() -> None:
    code = (
        "import sys, service.api.jobs.router, trainer.plan; "
        "sys.exit('torch' in sys.modules or 'transformers' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_a_run_that_cannot_fit_its_bound_is_refused_naming_keep_and_the_setting(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainer.plan import RNG_BYTES

    d = 32
    total = 2 * (12 * d * d + 13 * d) + 256 * d + 32 * d + 2 * d
    small = _body(api, checkpoint={"every": 20, "keep": 2, "hf": "final"})
    disk = _plan(api, small)["disk"]
    checkpoint = 4 * total + 8 * total + RNG_BYTES  # weights, AdamW's moments, one rank's RNG
    assert disk == {
        "checkpoint_bytes": checkpoint,
        "hf_bytes": 4 * total,
        "run_bytes": 2 * checkpoint + checkpoint,  # two kept while the third is written
    }
    # The spec: every checkpoint kept (up to 1000) with its Hugging Face folder.
    monkeypatch.setattr(api.services.settings, "runs_max_job_bytes", 50 * checkpoint)
    greedy = _body(api, checkpoint={"every": 20, "keep": 1000, "hf": "every"})
    for params in ({}, {"dry_run": "true"}):
        r = api.client.post("/v1/jobs", params=params, json=greedy, headers=api.headers())
        assert r.status_code == 422, r.text
        [err] = r.json()["detail"]
        assert err["loc"] == ["body", "train", "checkpoint", "keep"]
        most = 49 * checkpoint // (checkpoint + 4 * total)  # what fits beside the one written
        assert "TRAINQ_RUNS_MAX_JOB_BYTES" in err["msg"] and f"keep at most {most}" in err["msg"]
    assert _my_jobs(api) == [] and _broker_len(api) == 0
    ok = api.client.post("/v1/jobs", json=small, headers=api.headers())
    assert ok.status_code == 201, ok.text


def test_hsdp_replicate_is_checked_and_shards_within_a_node(api: Api) -> None:
    body = {**_body(api, strategy="fsdp", fsdp={"replicate": 3}), "nodes": 2, "procs_per_node": 2}
    resp = api.client.post("/v1/jobs", json=body, headers=api.headers())
    assert resp.status_code == 422, resp.text
    detail = resp.json()["detail"][0]
    assert detail["loc"] == ["body", "train", "fsdp", "replicate"]
    assert "must divide the world size (4" in detail["msg"]

    body["train"]["fsdp"] = {"replicate": "auto"}  # 2 nodes: one replica per node
    out = _plan(api, body)
    assert {k: out["layout"][k] for k in ("strategy", "replicate", "shard")} == {
        "strategy": "hsdp",
        "replicate": 2,
        "shard": 2,
    }
    assert _my_jobs(api) == []


MOE = {**TINY, "family": "moe", "n_kv_head": 2, "ffn_hidden": 48, "n_experts": 4, "top_k": 2}


@pytest.mark.parametrize(
    ("train", "says"),
    [
        (  # 3 divides the 6 experts but not the 4 ranks (trainer.mesh)
            {"model": {**MOE, "n_experts": 6}, "expert_parallel": 3},
            "must divide the world size (4",
        ),
        # the config's own rules (trainer.config)
        ({"model": {**MOE, "n_experts": 6}, "expert_parallel": 4}, "model.n_experts (6)"),
        ({"model": TINY, "expert_parallel": 2}, "needs model.family moe"),
        ({"model": MOE, "expert_parallel": 2, "strategy": "fsdp"}, "strategy ddp only"),
        ({"model": MOE, "expert_parallel": 2, "precision": "fp16"}, "precision fp16"),
    ],
)
def test_bad_expert_parallel_is_a_422_naming_it(api: Api, train: dict[str, Any], says: str) -> None:
    body = {"name": "ep", "queue": api.queue, "procs_per_node": 4, "train": train}
    for params in ({"dry_run": "true"}, {}):
        resp = api.client.post("/v1/jobs", params=params, json=body, headers=api.headers())
        assert resp.status_code == 422, resp.text
        detail = resp.json()["detail"][0]
        assert detail["loc"] == ["body", "train", "expert_parallel"], detail
        assert "expert_parallel" in detail["msg"] and says in detail["msg"], detail
    assert _my_jobs(api) == [] and _broker_len(api) == 0


def test_expert_parallel_plans_a_rank_holding_its_share_of_the_experts(api: Api) -> None:
    got = {}
    for ep in (1, 2):
        body = {**_body(api, model=MOE, expert_parallel=ep), "procs_per_node": 2}
        got[ep] = _plan(api, body)
    one, two = got[1], got[2]
    assert one["parameters"] == two["parameters"]  # the model's, whatever holds it
    assert "split over groups of 2" in two["layout"]["describe"]
    experts = 2 * 3 * 32 * 48 * 4  # 2 layers of 4 SwiGLU experts, 32 wide, 48 hidden
    for term, per_param in (("weights", 4), ("optimizer", 8)):
        assert one["memory"]["device"][term] - two["memory"]["device"][term] == (
            per_param * experts // 2
        ), term
