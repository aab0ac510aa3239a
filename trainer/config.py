"""The training spec: one pydantic definition the service validates with and the trainer runs from.

This module imports neither torch nor redis, so the API process can validate specs without
loading either. Every model forbids unknown fields and bounds every number, so a typo or an
absurd value is a 422 naming the field rather than a failure on a GPU host an hour later.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

__all__ = [
    "BatchConfig",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "ModelConfig",
    "OptimConfig",
    "TrainConfig",
    "load_config",
    "reject_nul",
    "resolve_data_path",
]


class ConfigError(ValueError):
    """A config that cannot be run; the message names the field."""


class _Strict(BaseModel):
    # strict: a spec is a contract for CI, so "5" is not an int and true is not a number.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class ModelConfig(_Strict):
    n_layer: int = Field(2, ge=1, le=128)
    n_head: int = Field(2, ge=1, le=256)
    d_model: int = Field(64, ge=8, le=32768)
    seq_len: int = Field(64, ge=2, le=131072)
    vocab_size: int = Field(256, ge=2, le=1_048_576)
    mlp_ratio: int = Field(4, ge=1, le=16)

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ModelConfig:
        if self.d_model % self.n_head:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})"
            )
        return self


def reject_nul(value: str) -> str:
    """A pydantic validator for spec strings: U+0000 fits neither a file name nor
    PostgreSQL text, so it is refused as bad input here rather than failing later."""
    if "\x00" in value:
        raise ValueError("must not contain NUL (U+0000) characters")
    return value


class DataConfig(_Strict):
    # A folder of llm.c-format shards train*.bin / val*.bin, relative to the data root.
    path: str = Field("tiny", min_length=1, max_length=1024)

    _no_nul = field_validator("path")(reject_nul)  # no file system takes it


class BatchConfig(_Strict):
    micro_batch_size: int = Field(8, ge=1, le=65536)
    grad_accum_steps: int = Field(1, ge=1, le=4096)


class OptimConfig(_Strict):
    lr: float = Field(3.0e-4, gt=0, le=10)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    weight_decay: float = Field(0.1, ge=0, le=10)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-8, gt=0, le=1)
    warmup_steps: int = Field(10, ge=0, le=10_000_000)
    grad_clip: float = Field(1.0, ge=0, le=1e6)  # 0 turns clipping off


class EvalConfig(_Strict):
    every: int = Field(50, ge=0, le=10_000_000)  # 0 turns eval off
    steps: int = Field(5, ge=1, le=100_000)


class CheckpointConfig(_Strict):
    every: int = Field(50, ge=0, le=10_000_000)  # 0: only at the end and on SIGTERM
    keep: int = Field(2, ge=1, le=1000)


class TrainConfig(_Strict):
    strategy: Literal["ddp", "fsdp"] = "ddp"
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    steps: int = Field(200, ge=1, le=100_000_000)
    seed: int = Field(42, ge=0, le=2**32 - 1)
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    batch: BatchConfig = BatchConfig()
    optim: OptimConfig = OptimConfig()
    eval: EvalConfig = EvalConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    log_every: int = Field(1, ge=1, le=1_000_000)
    compile: bool = False

    @model_validator(mode="after")
    def _fp16_needs_ddp(self) -> TrainConfig:
        # GradScaler would skip steps per rank on its own shard's overflow under FSDP, so
        # ranks could disagree; bf16 needs no scaler. (fp16 also needs CUDA, which only the
        # host that runs the job can tell.)
        if self.precision == "fp16" and self.strategy == "fsdp":
            raise ValueError("precision fp16 works with strategy ddp only; use bf16 with fsdp")
        return self

    @property
    def tokens_per_step_per_rank(self) -> int:
        return self.batch.micro_batch_size * self.batch.grad_accum_steps * self.model.seq_len


def _format_error(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(root)"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


def load_config(source: str | os.PathLike[str] | dict[str, Any]) -> TrainConfig:
    """Load a TrainConfig from a dict or a JSON/YAML file; ConfigError names the bad field."""
    if isinstance(source, dict):
        raw: Any = source
    else:
        path = Path(source)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read config {path}: {exc.strerror}") from exc
        try:
            if path.suffix.lower() == ".json":
                raw = json.loads(text)
            else:
                from trainer.yamlspec import load_yaml  # any other suffix: YAML (and JSON)

                raw = load_yaml(text)
        except Exception as exc:  # json.JSONDecodeError, yaml.YAMLError (not a ValueError)
            raise ConfigError(f"config {path} is not valid JSON/YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError("config must be a mapping at the top level")
    try:
        return TrainConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"invalid config: {_format_error(exc)}") from exc


def resolve_data_path(
    path: str, root: str | os.PathLike[str] | None, *, allow_absolute: bool = False
) -> Path:
    """Resolve a spec's data path against the data root; refuse anything that leaves the root.

    A relative path must still be inside the root once `..` and symlinks are resolved. An
    absolute path is refused unless `allow_absolute` (the trainer run by hand may name any
    folder; a spec sent to the service may not). Without a root, the path is taken as given.
    """
    candidate = Path(path)
    if candidate.is_absolute():
        if allow_absolute:
            return candidate.resolve()
        raise ConfigError(f"data.path must be relative to the data root, got absolute {path!r}")
    if root is None:
        return candidate.resolve()
    root_path = Path(root).resolve()
    resolved = (root_path / candidate).resolve()
    if not resolved.is_relative_to(root_path):
        raise ConfigError(f"data.path {path!r} resolves outside the data root")
    return resolved
