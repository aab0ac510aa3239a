"""The training spec: one pydantic definition the service validates with and the trainer runs from.

This module imports neither torch nor redis, so the API process can validate specs without
loading either. Every model forbids unknown fields and bounds every number, so a typo or an
absurd value is a 422 naming the field rather than a failure on a GPU host an hour later.
"""

from __future__ import annotations

import json
import os
import re
import urllib.parse
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from trainer.files import first_link
from trainer.paths import PathRefused, resolve_under

__all__ = [
    "DEFAULT_LORA_TARGETS",
    "AnyModelConfig",
    "BatchConfig",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "FSDPConfig",
    "HFModelConfig",
    "InitConfig",
    "LlamaConfig",
    "LoraConfig",
    "MlflowConfig",
    "ModelConfig",
    "MoeConfig",
    "OptimConfig",
    "TrackingConfig",
    "TrainConfig",
    "WandbConfig",
    "frozen_data_path",
    "load_config",
    "lora_matches",
    "reject_nul",
    "resolve_data_path",
    "resolve_init_path",
    "resolve_model_path",
]


class ConfigError(ValueError):
    """A config that cannot be run; the message names the field."""


class _Strict(BaseModel):
    # strict: a spec is a contract for CI, so "5" is not an int and true is not a number.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class ModelConfig(_Strict):
    """``family: gpt``: trainq's GPT (trainer/model.py), the default when no family is named."""

    family: Literal["gpt"] = "gpt"
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


class LlamaConfig(_Strict):
    """``family: llama``: a Llama-style decoder (trainer/llama.py): RMSNorm, rotary position
    embeddings, SwiGLU MLP, grouped-query attention, no biases."""

    family: Literal["llama"]
    n_layer: int = Field(2, ge=1, le=256)
    n_head: int = Field(4, ge=1, le=256)
    # Key/value heads (grouped-query attention); None: as many as n_head.
    n_kv_head: int | None = Field(None, ge=1, le=256)
    d_model: int = Field(64, ge=8, le=65536)
    seq_len: int = Field(64, ge=2, le=131072)
    vocab_size: int = Field(256, ge=2, le=1_048_576)
    # The SwiGLU hidden width; None: Llama's 8/3 * d_model rounded up to multiple_of.
    ffn_hidden: int | None = Field(None, ge=1, le=1_048_576)
    multiple_of: int = Field(32, ge=1, le=4096)
    rope_theta: float = Field(10000.0, gt=0, le=1e9)
    norm_eps: float = Field(1e-5, gt=0, le=0.1)
    tie_embeddings: bool = False

    @model_validator(mode="after")
    def _heads(self) -> LlamaConfig:
        if self.d_model % self.n_head:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})"
            )
        if (self.d_model // self.n_head) % 2:
            raise ValueError(
                f"head size d_model/n_head ({self.d_model // self.n_head}) must be even (rotary)"
            )
        if self.n_head % self.kv_heads:
            raise ValueError(
                f"n_head ({self.n_head}) must be divisible by n_kv_head ({self.kv_heads})"
            )
        return self

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def hidden(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        h = int(2 * 4 * self.d_model / 3)
        return self.multiple_of * ((h + self.multiple_of - 1) // self.multiple_of)


class MoeConfig(LlamaConfig):
    """``family: moe``: the llama decoder with each feed-forward replaced by ``n_experts``
    SwiGLU experts (``ffn_hidden`` wide each) and a top-``top_k`` router (trainer/moe.py),
    Mixtral's design. ``aux_loss_coef``: the load-balancing loss's weight (Switch/Mixtral's
    form, transformers' ``router_aux_loss_coef``); ``router_z_loss_coef``: ST-MoE's z-loss."""

    family: Literal["moe"]  # type: ignore[assignment]
    n_experts: int = Field(4, ge=1, le=1024)
    top_k: int = Field(2, ge=1, le=64)
    aux_loss_coef: float = Field(0.01, ge=0, le=100)
    router_z_loss_coef: float = Field(0.0, ge=0, le=100)

    @model_validator(mode="after")
    def _top_k(self) -> MoeConfig:
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k ({self.top_k}) must be at most n_experts ({self.n_experts})")
        return self


class HFModelConfig(_Strict):
    """``family: hf``: any causal language model ``transformers`` builds from a local folder
    (trainer/hfmodel.py). ``from_pretrained`` semantics: a folder with weights starts from
    them (fine-tuning); a folder with only ``config.json`` starts from fresh weights drawn
    from the seed. Needs the ``hf`` extra on the worker (``pip install 'trainq[hf]'``)."""

    family: Literal["hf"]
    # The folder, relative to the data root (the same escape rules as data.path).
    path: str = Field(min_length=1, max_length=1024)
    seq_len: int = Field(1024, ge=2, le=131072)

    _no_nul = field_validator("path")(lambda v: reject_nul(v))


def _family(value: Any) -> str:
    if isinstance(value, dict):
        return str(value.get("family", "gpt"))
    return str(getattr(value, "family", "gpt"))


# The model a job trains, by family; a spec without ``family`` is a GPT (the first family).
AnyModelConfig = Annotated[
    Annotated[ModelConfig, Tag("gpt")]
    | Annotated[LlamaConfig, Tag("llama")]
    | Annotated[MoeConfig, Tag("moe")]
    | Annotated[HFModelConfig, Tag("hf")],
    Discriminator(_family),
]


def reject_nul(value: str) -> str:
    """A pydantic validator for spec strings: U+0000 fits neither a file name nor
    PostgreSQL text, so it is refused as bad input here rather than failing later."""
    if "\x00" in value:
        raise ValueError("must not contain NUL (U+0000) characters")
    return value


class DataConfig(_Strict):
    # A folder of llm.c-format shards train*.bin / val*.bin, relative to the data root.
    path: str = Field("tiny", min_length=1, max_length=1024)
    # A dataset uploaded to the service (POST /v1/datasets), by name. The service resolves
    # it at submit for the submitting owner and freezes its folder into ``path`` (a spec
    # sent with both is refused there); the trainer reads only ``path``.
    dataset: str | None = Field(
        None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
    )

    # Chat and completion data: whole examples packed into seq_len rows, positions
    # restarting and attention kept inside each example (trainer.data); off: the tokens
    # cut into seq_len+1 windows as any corpus.
    packing: bool = False

    _no_nul = field_validator("path")(reject_nul)  # no file system takes it


# Spec keys that each name one choice among alternatives the models refuse together: a
# folder or an uploaded dataset (DataConfig), a folder or a job's checkpoint, whose step goes
# with the job (InitConfig). Setting one over a spec file (``trainq submit --set``) drops the
# others, so ``--set train.data.dataset=NAME`` on a spec with ``data.path`` trains on NAME.
REPLACES: dict[str, tuple[str, ...]] = {
    "train.data.dataset": ("train.data.path",),
    "train.data.path": ("train.data.dataset",),
    "train.init.path": ("train.init.job", "train.init.step"),
    "train.init.job": ("train.init.path",),
}


def drop_replaced(spec: dict[str, Any], path: str) -> None:
    """Remove from a spec (plain JSON) the alternatives a value set at ``path`` replaces
    (``REPLACES``), which the API would refuse beside it: ``--set`` and a sweep's trials."""
    for other in REPLACES.get(path, ()):
        *parents, leaf = other.split(".")
        node: Any = spec
        for key in parents:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)


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


class InitConfig(_Strict):
    """Start from weights instead of drawing them (fine-tuning): a Hugging Face folder under
    the data root (``path``), or another trainq job's checkpoint (``job``, its ``step`` or
    its latest). The step counter, optimizer and data position start fresh."""

    path: str | None = Field(None, min_length=1, max_length=1024)
    job: str | None = Field(None, pattern=r"^[0-9a-f]{1,32}$")
    step: int | None = Field(None, ge=1)

    _no_nul = field_validator("path")(lambda v: v if v is None else reject_nul(v))

    @model_validator(mode="after")
    def _one_source(self) -> InitConfig:
        if (self.path is None) == (self.job is None):
            raise ValueError("init names exactly one of path (a Hugging Face folder) or job")
        if self.step is not None and self.job is None:
            raise ValueError("init.step goes with init.job")
        return self


# The linears LoRA adapts when the spec names no targets: each family's attention
# projections (the LoRA paper's choice). trainer.lora applies them, trainer.plan counts them.
DEFAULT_LORA_TARGETS: dict[str, tuple[str, ...]] = {
    "gpt": ("attn.qkv", "attn.proj"),
    "llama": ("attention.wq", "attention.wk", "attention.wv", "attention.wo"),
    "moe": ("attention.wq", "attention.wk", "attention.wv", "attention.wo"),
    "hf": ("q_proj", "k_proj", "v_proj", "o_proj"),
}


def lora_matches(name: str, targets: tuple[str, ...]) -> bool:
    """A linear whose full name is a target, or ends with ``.`` + a target, is adapted."""
    return any(name == t or name.endswith("." + t) for t in targets)


class LoraConfig(_Strict):
    """Low-rank adapters: the base weights frozen, ``W x + (alpha/rank) B A x`` trained for
    each linear whose name ends with one of ``targets`` (default: the attention
    projections of the family: wq/wk/wv/wo, qkv/proj for gpt, q/k/v/o_proj for hf)."""

    rank: int = Field(8, ge=1, le=1024)
    alpha: float = Field(16.0, gt=0, le=4096)
    dropout: float = Field(0.0, ge=0, lt=1)
    targets: list[str] | None = Field(None, min_length=1, max_length=64)


class FSDPConfig(_Strict):
    """FSDP2's memory choices (strategy fsdp only)."""

    # Free each block's gathered parameters after its forward (re-gathered for backward):
    # ZeRO-3's memory; False keeps them until backward (ZeRO-2's), trading memory for a gather.
    reshard_after_forward: bool = True
    # Parameters, gradients and optimizer state live in CPU memory, copied to the device per
    # block: the native counterpart of ZeRO-Offload (slower; for models that do not fit).
    cpu_offload: bool = False
    # HSDP: the ranks form a (replicate, shard) mesh; each parameter is sharded over the
    # ranks of a shard group (a node's, by torchrun's rank order) and replicated across the
    # groups, so only the gradient all-reduce crosses nodes. auto: the number of nodes when
    # the job has several, else 1 (plain FSDP); N must divide the world size (trainer.mesh).
    replicate: Literal["auto"] | Annotated[int, Field(ge=1, le=65536)] = "auto"


class CheckpointConfig(_Strict):
    every: int = Field(50, ge=0, le=10_000_000)  # 0: only at the end and on SIGTERM
    keep: int = Field(2, ge=1, le=1000)
    # The Hugging Face folder step-N/hf/ (trainer.publish): for the finished run's last
    # checkpoint, for every checkpoint as it is saved, or never.
    hf: Literal["final", "every", "none"] = "final"


# Experiment trackers (train.tracking; trainer.tracking sends, rank 0 only). ---------------

# A key never travels in a spec: a field named like one, or a value shaped like a W&B key
# (40 hex digits, or its newer prefixed forms), is refused with a message saying where it goes.
_KEY_NAME = re.compile(r"(api_?key|key|token|secret|password|passwd|credential)", re.I)
_KEY_VALUE = re.compile(r"(?:[0-9a-f]{40}|(?:local|wandb_v\d+)[-_][0-9A-Za-z_-]{20,})")
_KEYS_GO = (
    "keys never go in a spec: wandb online mode uses WANDB_API_KEY from the worker's"
    " environment or the owner's secret that an admin sets; an MLflow server's credentials"
    " are the worker's MLFLOW_TRACKING_* variables"
)


def _no_keys(value: Any) -> Any:
    """A model_validator(mode="before"): refuse key-like field names and values."""
    if isinstance(value, dict):
        for name, item in value.items():
            if isinstance(name, str) and _KEY_NAME.search(name):
                raise ValueError(f"field {name!r} is not allowed: {_KEYS_GO}")
            for text in item if isinstance(item, list) else [item]:
                if isinstance(text, str) and _KEY_VALUE.search(text):
                    raise ValueError(
                        f"{name} looks like an API key ({_KEYS_GO}; a git commit: its short form)"
                    )
    return value


_TRACK_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


class WandbConfig(_Strict):
    """Weights & Biases: ``offline`` writes RUN_DIR/wandb/ for ``wandb sync``; ``online``
    sends, with the key of the worker's environment (WANDB_API_KEY)."""

    project: str = Field(min_length=1, max_length=128, pattern=_TRACK_NAME)
    entity: str | None = Field(None, min_length=1, max_length=128, pattern=_TRACK_NAME)
    name: str | None = Field(None, min_length=1, max_length=128)  # default: the job id
    tags: list[Annotated[str, Field(min_length=1, max_length=64)]] = Field(
        default_factory=list, max_length=32
    )
    mode: Literal["offline", "online"] = "offline"

    _no_nul = field_validator("name")(lambda v: v if v is None else reject_nul(v))
    _keys = model_validator(mode="before")(_no_keys)

    @field_validator("tags")
    @classmethod
    def _tags_text(cls, v: list[str]) -> list[str]:
        return [reject_nul(t) for t in v]


class MlflowConfig(_Strict):
    """MLflow: a tracking server's http(s) URI (an outbound URL, trainer.outbound) and the
    experiment the run goes in (made when missing)."""

    tracking_uri: str = Field(min_length=1, max_length=2048)
    experiment: str = Field("trainq", min_length=1, max_length=256)
    run_name: str | None = Field(None, min_length=1, max_length=256)  # default: job-attempt

    _no_nul = field_validator("experiment", "run_name")(lambda v: v if v is None else reject_nul(v))
    _keys = model_validator(mode="before")(_no_keys)

    @field_validator("tracking_uri")
    @classmethod
    def _outbound(cls, v: str) -> str:
        from trainer.outbound import check_url

        # The form only (http(s), a host, no credentials); whether its address may be
        # reached is the service's and the worker's setting, checked at submit and in the run.
        parts = check_url(v, allow_private=True)
        if any(_KEY_NAME.search(k) for k in urllib.parse.parse_qs(parts.query)):
            raise ValueError(f"the URI's query carries a key: {_KEYS_GO}")
        return v


class TrackingConfig(_Strict):
    wandb: WandbConfig | None = None
    mlflow: MlflowConfig | None = None

    _keys = model_validator(mode="before")(_no_keys)


class TrainConfig(_Strict):
    strategy: Literal["ddp", "fsdp"] = "ddp"
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    steps: int = Field(200, ge=1, le=100_000_000)
    seed: int = Field(42, ge=0, le=2**32 - 1)
    model: AnyModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    batch: BatchConfig = BatchConfig()
    optim: OptimConfig = OptimConfig()
    eval: EvalConfig = EvalConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    log_every: int = Field(1, ge=1, le=1_000_000)
    compile: bool = False
    # Recompute activations in backward instead of keeping them: every block (full), or
    # every second block (selective, torchtitan's layer-wise option); numerically the same.
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    fsdp: FSDPConfig = FSDPConfig()
    # moe: the experts of each layer split over groups of this many ranks (expert
    # parallelism, trainer.parallelize.apply_ep); it divides model.n_experts and the world
    # size (trainer.mesh). Under strategy ddp only (FSDP2's 2-D mesh with experts is not built).
    expert_parallel: int = Field(1, ge=1, le=1024)
    init: InitConfig | None = None
    lora: LoraConfig | None = None
    tracking: TrackingConfig | None = None  # experiment trackers (trainer.tracking)

    @model_validator(mode="after")
    def _fp16_needs_ddp(self) -> TrainConfig:
        # GradScaler would skip steps per rank on its own shard's overflow under FSDP, so
        # ranks could disagree; bf16 needs no scaler. (fp16 also needs CUDA, which only the
        # host that runs the job can tell.)
        if self.precision == "fp16" and self.strategy == "fsdp":
            raise ValueError("precision fp16 works with strategy ddp only; use bf16 with fsdp")
        if self.strategy != "fsdp" and self.fsdp != FSDPConfig():
            raise ValueError(
                "fsdp options (cpu_offload, reshard_after_forward, replicate) need strategy fsdp"
            )
        return self

    @field_validator("expert_parallel")
    @classmethod
    def _expert_parallel(cls, ep: int, info: ValidationInfo) -> int:
        # A field validator, so the error's loc names expert_parallel (a 422's
        # ["body", "train", "expert_parallel"]); model, strategy and precision come before it,
        # so they are validated already (absent: invalid, and reported on their own).
        if ep == 1:
            return ep
        model = info.data.get("model")
        if model is not None and not isinstance(model, MoeConfig):
            raise ValueError("expert_parallel > 1 needs model.family moe")
        if isinstance(model, MoeConfig) and model.n_experts % ep:
            raise ValueError(
                f"expert_parallel ({ep}) must divide model.n_experts ({model.n_experts})"
            )
        if info.data.get("strategy") == "fsdp":
            raise ValueError("expert_parallel > 1 works with strategy ddp only (not yet fsdp)")
        if info.data.get("precision") == "fp16":
            # GradScaler skips a step on its own rank's overflow, and the ranks' expert slices
            # differ: they would skip different steps and their replicas drift apart.
            raise ValueError("expert_parallel > 1 does not work with precision fp16; use bf16")
        return ep

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
    path: str,
    root: str | os.PathLike[str] | None,
    *,
    allow_absolute: bool = False,
    field: str = "data.path",
    dataset: str | None = None,
    owner: str | None = None,
) -> Path:
    """Resolve a path of a spec (``field``) against the data root by the one rule of
    ``trainer.paths.resolve_under``: a plain relative path in the shared area, no link on
    the way, never ``datasets/`` (but ``dataset``'s own frozen folder, see there).

    Without a root (the trainer run by hand) the path is taken as given, and an absolute
    path only with ``allow_absolute`` (a spec sent to the service never has one)."""
    if root is None or (allow_absolute and Path(path).is_absolute()):
        if Path(path).is_absolute() and not allow_absolute:
            raise ConfigError(f"{field} must be relative to the data root, got an absolute path")
        return Path(path).resolve()
    try:
        return resolve_under(root, path, field, dataset=dataset, owner=owner)
    except PathRefused as exc:
        raise ConfigError(str(exc)) from None


def frozen_data_path(
    cfg: TrainConfig, root: str | os.PathLike[str] | None, owner: str | None = None
) -> Path:
    """A stored spec's ``data.path`` (its ``data.dataset``'s frozen folder allowed)."""
    return resolve_data_path(
        cfg.data.path, root, allow_absolute=root is None, dataset=cfg.data.dataset, owner=owner
    )


def resolve_model_path(
    cfg: AnyModelConfig, data_root: str | os.PathLike[str] | None
) -> AnyModelConfig:
    """An ``hf`` config with its folder resolved against the data root (the escape rules of
    data paths); other families as they are."""
    if not isinstance(cfg, HFModelConfig):
        return cfg
    folder = resolve_data_path(
        cfg.path, data_root, allow_absolute=data_root is None, field="model.path"
    )
    if not folder.is_dir():
        raise ConfigError(f"model.path {cfg.path!r} is not a folder under the data root")
    require_no_links(folder, f"model.path {cfg.path!r}")
    require_extra("transformers", "model.family hf")
    return cfg.model_copy(update={"path": str(folder)})


def require_no_links(folder: Path, label: str) -> None:
    """ConfigError when ``folder``'s tree holds a symbolic link: a folder that other code
    opens by path (transformers, safetensors, torch.distributed.checkpoint) must lead
    nowhere else (``trainer.paths``)."""
    link = first_link(folder)
    if link is not None:
        where = "" if link == "." else f": {link}"
        raise ConfigError(f"{label} holds a symbolic link{where}; links are not followed")


def require_extra(package: str, what: str) -> None:
    """ConfigError naming the ``hf`` extra when ``package`` is not installed here (the
    trainer asks before it imports torch, so a worker without it answers in a moment)."""
    import importlib.util

    if importlib.util.find_spec(package) is None:
        raise ConfigError(f"{what} needs {package} on the worker: pip install 'trainq[hf]'")


def resolve_init_path(cfg: TrainConfig, data_root: str | os.PathLike[str] | None) -> TrainConfig:
    """``train.init.path`` resolved against the data root (the escape rules of data paths)."""
    if cfg.init is None or cfg.init.path is None:
        return cfg
    folder = resolve_data_path(
        cfg.init.path, data_root, allow_absolute=data_root is None, field="init.path"
    )
    require_extra("safetensors", "init.path")
    return cfg.model_copy(update={"init": cfg.init.model_copy(update={"path": str(folder)})})
