"""Checkpoints: model, optimizer, scaler, progress and every rank's RNG, written atomically.

Layout under ``RUN_DIR/checkpoints/``::

    step-N/meta.json        step, tokens seen, strategy, world size, model config (rank 0)
    step-N/model.pt         DDP / one process: full model + optimizer state (rank 0); under
                            expert parallelism the experts gathered whole on rank 0 first
    step-N/dcp/             FSDP / HSDP: sharded model + optimizer (torch.distributed.checkpoint)
    step-N/scaler.pt        GradScaler state when fp16 (rank 0)
    step-N/rng-rank{r}.pt   each rank's python, numpy, torch (and CUDA) RNG
    step-N/DONE             written last: only a checkpoint with DONE is ever loaded

Every rank writes into ``tmp-step-N``; after a barrier rank 0 renames it to ``step-N``, writes
DONE and prunes to the newest ``keep``. A crash at any point leaves the previous good one.
Before it writes, rank 0 checks that the file system holds the checkpoint (its estimate from
the model, ``checkpoint_bytes``, and the Hugging Face folder when one follows each save);
short of room, or when a write fails for want of it (ENOSPC), the rank removes the temp folder
and raises ``DiskFull``: the run ends with reason ``disk_full``, the disk keeps its room.
Folders are made 0750 here; the files (ours, torch.save's, DCP's) are 0640 by the trainer's
umask (trainer.files), and the rename keeps both.
The batches are a pure function of the step (`trainer.data.BatchSampler`), so the data
position is just the next step, and a run resumes from either format under any strategy and
world size (`load_checkpoint`).
"""

from __future__ import annotations

import errno
import json
import random
import shutil
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from trainer.fence import Fence, Superseded
from trainer.files import make_dirs
from trainer.parallelize import ExpertShard, barrier, expert_shard, unwrap

__all__ = [
    "CheckpointError",
    "DiskFull",
    "Progress",
    "checkpoint_bytes",
    "checkpoint_dirs",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
]

DONE = "DONE"
# Room kept free beyond a checkpoint's estimate: the rank's own small writes (metrics,
# exit.json, the logs) still fit once a checkpoint is refused.
SPARE_BYTES = 4 * 2**20
RNG_BYTES = 64 * 2**10  # one rank's rng-rank{r}.pt and its share of meta.json, at most


class CheckpointError(Exception):
    """A checkpoint that cannot be resumed from here (another model's)."""


class DiskFull(Exception):
    """The run folder's file system has no room for a checkpoint (reason ``disk_full``)."""


def checkpoint_bytes(model: nn.Module, world_size: int, *, hf: bool = False) -> int:
    """An upper estimate of one checkpoint's bytes: the weights as stored (a sharded
    parameter counts whole), two AdamW moments of fp32 per trainable parameter, the ranks'
    RNG files; with ``hf``, the Hugging Face folder's weights beside it (fp32)."""
    params = list(model.parameters())
    numel = {id(p): p.numel() * _split(p) for p in params}  # a sliced expert counts whole
    weights = sum(numel[id(p)] * p.element_size() for p in params)
    weights += sum(b.numel() * b.element_size() for b in model.buffers())
    moments = sum(2 * 4 * numel[id(p)] for p in params if p.requires_grad)
    export = sum(4 * numel[id(p)] for p in params) if hf else 0
    return weights + moments + world_size * RNG_BYTES + export


def _split(p: torch.Tensor) -> int:
    """Over how many ranks ``p``'s experts are split (1: not an expert slice)."""
    shard = expert_shard(p)
    return shard.size if shard is not None else 1


def _no_space(exc: BaseException, root: Path) -> bool:
    """Whether ``exc`` is a write refused for want of room. torch.save does not say so (its
    zip writer reports ``iostream error`` or ``unexpected pos``), so a failed write on a
    file system with almost nothing left counts too."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen = seen.__cause__ or seen.__context__
    try:
        return shutil.disk_usage(root).free < SPARE_BYTES
    except OSError:
        return False


def _check_room(root: Path, need: int, step: int) -> None:
    free = shutil.disk_usage(root).free
    if free < need + SPARE_BYTES:
        raise DiskFull(
            f"no room for checkpoint step {step}: it needs about {need / 2**20:.1f} MiB and"
            f" {free / 2**20:.1f} MiB are free in the run folder (checkpoint.keep and"
            " checkpoint.hf set how much a run keeps)"
        )


@dataclass(frozen=True)
class Progress:
    step: int  # optimizer steps completed; also the next step of the data sampler
    tokens_seen: int


def checkpoint_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (with DONE), oldest first."""
    root = run_dir / "checkpoints"
    found = []
    for p in root.glob("step-*") if root.is_dir() else ():
        suffix = p.name.removeprefix("step-")
        if suffix.isdigit() and (p / DONE).is_file():
            found.append((int(suffix), p))
    return sorted(found)


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = checkpoint_dirs(run_dir)
    return found[-1][1] if found else None


def _rng_state() -> dict[str, Any]:
    # Plain containers and tensors only, so torch.load(weights_only=True) can read it back.
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(np.asarray(keys, dtype=np.int64)), pos, has_gauss, gauss),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(
    run_dir: Path,
    progress: Progress,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    *,
    strategy: str,
    rank: int,
    world_size: int,
    keep: int,
    model_config: dict[str, Any] | None = None,
    lora: dict[str, Any] | None = None,
    hf: bool = False,
    fence: Fence | None = None,
) -> Path:
    """Save collectively (every rank calls this at the same step); returns the final path.

    ``model_config`` (and ``lora``, the adapters' config) go into meta.json, so a checkpoint
    alone says what model it holds (what `trainer.export` builds to read it). ``hf``: a
    Hugging Face folder follows this save (its room is checked too). DiskFull when the file
    system has no room for it (nothing of it is left behind). ``fence`` (rank 0's, see
    trainer.fence): asked before anything is touched and before the checkpoint becomes
    visible; Superseded if a newer attempt of the job was claimed meanwhile."""
    root = run_dir / "checkpoints"
    tmp = root / f"tmp-step-{progress.step}"
    final = root / f"step-{progress.step}"
    _fenced(fence, progress.step)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a crash mid-save left it half written
        make_dirs(root)
        # Rank 0 alone decides (it raises before the barrier; the peers end with it).
        _check_room(root, checkpoint_bytes(model, world_size, hf=hf), progress.step)
        make_dirs(tmp / "dcp" if strategy == "fsdp" else tmp)
    barrier()
    full = False
    try:
        _write(tmp, progress, model, optimizer, scaler, strategy=strategy, rank=rank,
               world_size=world_size, model_config=model_config, lora=lora)  # fmt: skip
    except Exception as exc:
        if not _no_space(exc, root):
            raise
        full = True  # raised below: the traceback, and torch's open file with it, goes here
    if full:
        shutil.rmtree(tmp, ignore_errors=True)  # the room it took goes back at once
        raise DiskFull(
            f"no space left for checkpoint step {progress.step} (rank {rank}); its partial"
            " files were removed (checkpoint.keep and checkpoint.hf set how much a run keeps)"
        )
    barrier()  # every rank's files are in tmp before it becomes a checkpoint
    _fenced(fence, progress.step)
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)  # an incomplete one without DONE
        tmp.rename(final)
        (final / DONE).write_text(f"{progress.step}\n")
        if fence is not None:
            fence.published(progress.step)
        for _, old in checkpoint_dirs(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def _fenced(fence: Fence | None, step: int) -> None:
    """Rank 0 asks the fence, and every rank learns its answer, word for word (one broadcast):
    the whole superseded attempt stops together with one reason, so no rank of it records a
    crash (exit.json) in a run folder that is the next attempt's now."""
    if fence is None:
        return
    answer: list[str | None] = [fence.ask(step)]
    if dist.is_initialized():
        dist.broadcast_object_list(answer, src=0)
    if answer[0]:
        raise Superseded(answer[0])


def _write(
    tmp: Path,
    progress: Progress,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    *,
    strategy: str,
    rank: int,
    world_size: int,
    model_config: dict[str, Any] | None,
    lora: dict[str, Any] | None,
) -> None:
    """This rank's files of one checkpoint, into ``tmp``."""
    if strategy == "fsdp":
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=tmp / "dcp")
    else:
        whole = _whole_experts(model, optimizer, rank)  # collective under EP
        if whole is not None:
            model_sd, optim_sd = whole
            torch.save({"model": model_sd, "optimizer": optim_sd}, tmp / "model.pt")
    torch.save(_rng_state(), tmp / f"rng-rank{rank}.pt")
    if rank == 0:
        if scaler is not None and scaler.is_enabled():
            torch.save(scaler.state_dict(), tmp / "scaler.pt")
        meta = {
            **asdict(progress),
            "strategy": strategy,
            "world_size": world_size,
            "time": time.time(),
        }
        if model_config is not None:
            meta["model"] = model_config
        if lora is not None:
            meta["lora"] = lora
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")


def load_checkpoint(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    *,
    strategy: str,
    rank: int,
    device: torch.device,
) -> Progress:
    """Restore into an already parallelized model and its optimizer (every rank calls this),
    whatever strategy and world size wrote the checkpoint: one process, DDP, FSDP and HSDP
    hold the same parameters by the same names, only stored differently.

    - ``dcp/`` (FSDP, HSDP): DCP reads each rank's part of every tensor, into shards of any
      mesh (another world size, FSDP <-> HSDP) or whole tensors (DDP, one process), keyed
      by parameter name (``get_state_dict``);
    - ``model.pt`` (DDP, one process) into the same: loaded as it was saved; into FSDP or
      HSDP: as full state dicts that each rank cuts its shards from, the optimizer's state
      keyed by parameter name instead of position first."""
    meta = json.loads((path / "meta.json").read_text())
    try:
        if (path / "dcp").is_dir():
            model_sd, optim_sd = get_state_dict(model, optimizer)
            sliced = _whole_for_dcp(model_sd, optim_sd, model)
            # dcp.load fills these dicts in place, each rank reading only its own shards
            # (one process without torchrun: all of them; DCP warns of it, as intended here).
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "torch.distributed is disabled")
                dcp.load({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=path / "dcp")
            _cut(model_sd, optim_sd, sliced)
            set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
        elif strategy == "fsdp":
            _load_full_into_shards(path / "model.pt", model, optimizer)
        else:
            # Into host memory: each rank copies to its device only what it holds (its
            # slice of the experts under expert parallelism).
            state = torch.load(path / "model.pt", map_location="cpu", weights_only=True)
            _own_experts(state, model, optimizer)
            unwrap(model).load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, KeyError, ValueError) as exc:
        # A shape or key mismatch: the run dir holds a checkpoint of a different model.
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"checkpoint {path} does not fit this model: {first}") from exc
    if scaler is not None and (path / "scaler.pt").is_file():
        scaler.load_state_dict(torch.load(path / "scaler.pt", weights_only=True))
    rng = path / f"rng-rank{rank}.pt"
    if rng.is_file():  # absent when the world grew; the data order does not depend on it
        _set_rng_state(torch.load(rng, weights_only=True))
    return Progress(step=int(meta["step"]), tokens_seen=int(meta["tokens_seen"]))


def _load_full_into_shards(file: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """A whole-model ``model.pt`` into a sharded model: every rank reads it (on the CPU) and
    ``set_state_dict`` keeps the rank's own shards of each full tensor, with no collective."""
    saved = torch.load(file, map_location="cpu", weights_only=True)
    set_state_dict(
        model,
        optimizer,
        model_state_dict=saved["model"],
        optim_state_dict=_optimizer_by_name(saved["optimizer"], optimizer, model),
        options=StateDictOptions(full_state_dict=True),
    )


def _optimizer_by_name(
    saved: dict[str, Any], optimizer: torch.optim.Optimizer, model: nn.Module
) -> dict[str, Any]:
    """``optimizer.state_dict()`` numbers parameters by position over its groups; a state
    dict for ``set_state_dict`` names them. The optimizer is built the same way whatever the
    strategy (trainer.train.build_optimizer), so position i here is position i there."""
    names = {id(p): name for name, p in unwrap(model).named_parameters()}
    state: dict[str, Any] = {}
    groups = []
    for was, group in zip(saved["param_groups"], optimizer.param_groups, strict=True):
        fqns = [names[id(p)] for p in group["params"]]
        for index, fqn in zip(was["params"], fqns, strict=True):
            if index in saved["state"]:
                state[fqn] = saved["state"][index]
        groups.append({**was, "params": fqns})
    return {"state": state, "param_groups": groups}


# -- expert parallelism: the experts whole in model.pt, each rank's slice cut at load -------


def _sliced(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[str, int, Any]]:
    """(name, position in the optimizer's state dict, parameter) of every expert slice
    (trainer.parallelize.apply_ep); the positions are the state dict's numbering, over its
    groups in order."""
    position = {
        id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])
    }
    return [
        (name, position.get(id(p), -1), p)
        for name, p in unwrap(model).named_parameters()
        if expert_shard(p) is not None
    ]


def _gather(t: torch.Tensor, shard: ExpertShard, rank: int) -> torch.Tensor | None:
    """``t``'s slices gathered whole on rank 0, in host memory (one tensor's slices on its
    device at a time); None on the other ranks of its group."""
    parts = [torch.empty_like(t) for _ in range(shard.size)] if rank == 0 else None
    dist.gather(t.contiguous(), parts, dst=0, group=shard.group)
    return None if parts is None else torch.cat([part.cpu() for part in parts])


def _whole_experts(
    model: nn.Module, optimizer: torch.optim.Optimizer, rank: int
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """Rank 0's model and optimizer state dicts with every expert slice (and its AdamW
    moments) gathered whole from its group, in host memory: a checkpoint of an
    expert-parallel run is the one a DDP run writes, so it resumes at any expert_parallel,
    strategy or world size and exports as any other. Every rank calls it (the gathers are
    collective within rank 0's group; the other groups hold copies of the same slices and
    send nothing); None on every rank but 0."""
    sliced = _sliced(model, optimizer)
    shards = [shard for _, _, p in sliced if (shard := expert_shard(p)) is not None]
    if rank != 0 and (not shards or 0 not in dist.get_process_group_ranks(shards[0].group)):
        return None
    model_sd = unwrap(model).state_dict() if rank == 0 else {}
    optim_sd = optimizer.state_dict()
    state = dict(optim_sd["state"])
    for (name, index, p), shard in zip(sliced, shards, strict=True):
        whole = _gather(p.detach(), shard, rank)
        if whole is not None:
            model_sd[name] = whole
        if index in state:
            state[index] = {
                k: _gather(v, shard, rank) if v.shape == p.shape else v
                for k, v in state[index].items()
            }
    return (model_sd, {**optim_sd, "state": state}) if rank == 0 else None


def _own_experts(state: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Cut this rank's expert slices (and their AdamW moments) from a whole ``model.pt``,
    in place; nothing to do without expert parallelism."""
    for name, index, p in _sliced(model, optimizer):
        shard = expert_shard(p)
        assert shard is not None
        full = state["model"][name]
        lo, hi = shard.bounds(full.shape[0])
        state["model"][name] = full[lo:hi]
        moments = state["optimizer"]["state"].get(index)
        if moments is not None:
            state["optimizer"]["state"][index] = {
                k: v[lo:hi] if v.shape == full.shape else v for k, v in moments.items()
            }


def _whole_for_dcp(
    model_sd: dict[str, Any], optim_sd: dict[str, Any], model: nn.Module
) -> dict[str, tuple[int, int]]:
    """Under expert parallelism, a ``dcp/`` checkpoint (FSDP's) holds the experts whole: the
    state dicts `get_state_dict` gave get whole tensors for them to read into, in place;
    their bounds by name, for `_cut` after the read. The whole tensors are in host memory:
    only the rank's slices reach its device (``set_state_dict`` copies them in)."""
    bounds = {}
    for name, p in unwrap(model).named_parameters():
        shard = expert_shard(p)
        if shard is None:
            continue
        whole = (p.shape[0] * shard.size, *p.shape[1:])
        bounds[name] = shard.bounds(whole[0])
        model_sd[name] = torch.empty(whole, dtype=p.dtype)
        moments = optim_sd["state"].get(name, {})
        for k, v in moments.items():
            if v.shape == p.shape:
                moments[k] = torch.empty(whole, dtype=v.dtype)
    return bounds


def _cut(
    model_sd: dict[str, Any], optim_sd: dict[str, Any], bounds: dict[str, tuple[int, int]]
) -> None:
    """The rank's slices of what `_whole_for_dcp` made whole."""
    for name, (lo, hi) in bounds.items():
        full = model_sd[name]
        model_sd[name] = full[lo:hi]
        moments = optim_sd["state"].get(name, {})
        for k, v in moments.items():
            if v.shape == full.shape:
                moments[k] = v[lo:hi]
