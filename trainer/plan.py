"""A dry-run plan of a training spec: parameters, tokens per step and memory per device.

Pure arithmetic on the config: this module and its parts (trainer.plan_shape, the model's
shape; trainer.plan_memory, the parameter counts and the memory terms, with their formulas)
import ``trainer.config`` and the standard library only (no torch, no transformers), so the
API answers ``POST /v1/jobs?dry_run=true`` without loading either. A ``hf`` model's shape
comes from its ``config.json`` (read as JSON) under the data root; without it the plan says
so instead of failing.
"""

from __future__ import annotations

import os
from typing import Any

from trainer.config import TrainConfig
from trainer.mesh import layout
from trainer.plan_memory import (
    Run,
    device_memory,
    host_offloaded,
    parameter_counts,
    split_experts,
)
from trainer.plan_shape import model_shape

__all__ = ["RNG_BYTES", "disk", "fits", "plan", "run_disk"]

RNG_BYTES = 64 * 2**10  # one rank's RNG file and share of meta.json (trainer.checkpoint's)


# -- fits ------------------------------------------------------------------------------------


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def fits(
    total: int | None, devices: list[dict[str, Any]] | None, unknown: str | None
) -> tuple[bool | None, str, int | None]:
    """Whether the per-device estimate fits the smallest device of the queue."""
    if total is None:
        return None, "the memory could not be estimated", None
    if not devices:
        return None, unknown or "the queue's devices are not known", None
    sizes = [dev.get("memory_bytes") for dev in devices]
    if not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in sizes):
        return None, "the queue's workers do not report device memory", None
    smallest = min(int(x) for x in sizes if isinstance(x, int))
    on = f"{_gib(smallest)} on the queue's smallest device"
    if total > smallest:
        return False, f"{_gib(total)} per device exceeds {on}", smallest
    extra = "the CUDA context and NCCL's buffers come on top"
    return True, f"{_gib(total)} per device of {on}; {extra}", smallest


# -- disk ------------------------------------------------------------------------------------


def disk(train: TrainConfig, total: int, trainable: int, world: int) -> dict[str, int]:
    """Bytes a run folder holds (upper estimates, the trainer's own: trainer.checkpoint):
    one checkpoint (fp32 weights, AdamW's two fp32 moments per trainable parameter, each
    rank's RNG), one Hugging Face folder (fp32 weights), and the run at its worst: ``keep``
    checkpoints (each with its HF folder when ``hf: every``) while the next is written, or
    beside the final HF folder (``hf: final``)."""
    ck = train.checkpoint
    checkpoint = 4 * total + 8 * trainable + world * RNG_BYTES
    hf = 4 * total
    per_save = checkpoint + (hf if ck.hf == "every" else 0)
    worst = ck.keep * per_save + max(checkpoint, hf if ck.hf == "final" else 0)
    return {"checkpoint_bytes": checkpoint, "hf_bytes": hf, "run_bytes": worst}


def run_disk(
    train: TrainConfig, world: int, data_root: str | os.PathLike[str] | None = None
) -> dict[str, int] | None:
    """``disk`` of ``train`` on ``world`` ranks; None when the model's shape is unknown."""
    shape, _ = model_shape(train, data_root)
    if shape is None:
        return None
    counts = parameter_counts(shape, train)
    return disk(train, counts.total, counts.trainable, world)


# -- the plan --------------------------------------------------------------------------------


def plan(
    train: TrainConfig,
    *,
    procs_per_node: int,
    nodes: int,
    data_root: str | os.PathLike[str] | None = None,
    devices: list[dict[str, Any]] | None = None,
    devices_unknown: str | None = None,
) -> dict[str, Any]:
    """The plan of ``train`` on ``nodes * procs_per_node`` ranks (see the module's formulas).

    ``devices``: the queue's devices, each ``{"memory_bytes": int, ...}``; None when not known
    (``devices_unknown`` says why), and then ``fits`` is None with that reason.
    """
    world = nodes * procs_per_node
    micro = train.batch.micro_batch_size * train.model.seq_len
    shape, notes = model_shape(train, data_root)
    mesh = layout(train, world, nodes)  # the service refused a replicate that does not divide
    out: dict[str, Any] = {
        "family": train.model.family,
        "world_size": world,
        "layout": {
            "strategy": mesh.strategy,
            "replicate": mesh.replicate,
            "shard": mesh.shard,
            "describe": mesh.describe(),
        },
        "tokens_per_step": micro * train.batch.grad_accum_steps * world,
        "parameters": {"total": None, "trainable": None, "active": None},
        "memory": None,
        "disk": None,
    }
    total = None
    if shape is not None:
        counts = parameter_counts(shape, train)
        out["parameters"] = {
            "total": counts.total,
            "trainable": counts.trainable,
            # what one token computes with: all of them, but the experts it skips (moe)
            "active": counts.total - shape.n_layer * shape.idle_block_params,
        }
        out["disk"] = disk(train, counts.total, counts.trainable, world)
        if train.lora is not None and counts.trainable == 0:
            notes.append("lora.targets match no linear of the model: the trainer refuses it")
        fsdp = train.strategy == "fsdp"
        run = Run(
            shape=shape,
            counts=split_experts(counts, shape, mesh.expert),  # what one rank holds
            tokens=micro,
            world=mesh.shard,  # FSDP shards over the shard dimension only (HSDP replicates)
            fsdp=fsdp,
            offload=fsdp and train.fsdp.cpu_offload,
            half=train.precision in ("bf16", "fp16"),
            reshard=train.fsdp.reshard_after_forward,
            ac=train.activation_checkpointing,
            accum=train.batch.grad_accum_steps,
            lora_rank=train.lora.rank if train.lora else 0,
            lora_dropout=bool(train.lora and train.lora.dropout),
        )
        device = device_memory(run)
        host = host_offloaded(run)
        out["memory"] = {
            "device": device,
            "host": host,
            "host_per_node": host["total"] * procs_per_node,
        }
        total = device["total"]
        if train.compile:
            notes.append("compile is not modelled (its fusions usually keep fewer activations)")
    ok, reason, smallest = fits(total, devices, devices_unknown)
    out.update(fits=ok, fits_reason=reason, device_memory_bytes=smallest, notes=notes)
    return out
