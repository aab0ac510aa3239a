"""A run's checkpoint read back as a model: its config and its weights, whatever strategy wrote
them, on the CPU without a process group. Export (trainer.export, trainer.hf) and generation
(trainer.generate, the worker) start here.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint import latest_checkpoint
from trainer.config import AnyModelConfig, LoraConfig, load_config
from trainer.lora import apply_lora, merge_lora, targets_for
from trainer.models import build_model, model_config

__all__ = ["ATOL", "ExportError", "checkpoint_config", "load_model"]

ATOL = 1e-4  # the largest absolute logit difference (fp32) an export may show


class ExportError(Exception):
    """Nothing to export, or an export that does not reproduce the model; one line."""


def checkpoint_config(
    path: Path, config: Path | None = None
) -> tuple[dict[str, Any], AnyModelConfig]:
    """A checkpoint's meta.json and the config of the model it holds (read, nothing built)."""
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError) as exc:
        raise ExportError(f"{path} is not a checkpoint: {exc}") from exc
    return meta, _model_config(path, meta, config)


def _model_config(checkpoint: Path, meta: dict[str, Any], config: Path | None) -> AnyModelConfig:
    if config is not None:
        return load_config(config).model
    if "model" in meta:
        return model_config(meta["model"])
    fallback = checkpoint.parent.parent / "config.json"
    if fallback.is_file():
        return load_config(fallback).model
    raise ExportError(f"{checkpoint}/meta.json names no model and there is no {fallback}: "
                      "pass --config")  # fmt: skip


def load_model(
    run_dir: Path,
    checkpoint: Path | None = None,
    config: Path | None = None,
    *,
    merge: bool = True,
) -> tuple[Any, int]:
    """The checkpointed model (any family) on the CPU in eval mode, and its step. A LoRA
    run's adapters are merged into the base weights (``merge=False``: kept as adapters)."""
    path = checkpoint or latest_checkpoint(run_dir)
    if path is None:
        raise ExportError(f"no complete checkpoint in {run_dir / 'checkpoints'}")
    meta, model_cfg = checkpoint_config(path, config)
    model: Any = build_model(model_cfg)
    lora = LoraConfig.model_validate(meta["lora"]) if meta.get("lora") else None
    if lora is not None:
        apply_lora(model, lora, targets_for(model_cfg, lora))
    try:
        if meta["strategy"] == "fsdp":
            import torch.distributed.checkpoint as dcp

            # A tied head is the embedding: DCP stores it once, under the embedding's name.
            own = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
            state = {k: v for k, v in model.state_dict().items() if k in own}
            with warnings.catch_warnings():  # it warns of no process group even when asked
                warnings.filterwarnings("ignore", "torch.distributed is disabled")
                dcp.load({"model": state}, checkpoint_id=path / "dcp", no_dist=True)
            model.load_state_dict(state, strict=False)
        else:
            saved = torch.load(path / "model.pt", map_location="cpu", weights_only=True)
            model.load_state_dict(saved["model"])
    except (RuntimeError, KeyError, ValueError, OSError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ExportError(f"checkpoint {path} does not fit its model config: {first}") from exc
    if lora is not None and merge:
        merge_lora(model)
    return model.eval(), int(meta["step"])
