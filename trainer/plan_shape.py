"""The model of a spec as the dry-run plan sees it (trainer.plan): a `Shape` per family,
its parameters by block and root, its linears, and what a block keeps for backward.

Torch-free, like the whole plan: trainq's GPT and Llama from their config, a ``hf`` model
from its ``config.json`` under the data root (read as JSON, bounded in size; GPT-2 and the
Llama-style decoders exactly, other model types approximately).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from typing import Any, Literal

from trainer.config import (
    ConfigError,
    HFModelConfig,
    LlamaConfig,
    ModelConfig,
    MoeConfig,
    TrainConfig,
    resolve_data_path,
)
from trainer.files import NotPlainFile, read_plain

__all__ = ["Linear", "Shape", "hf_shape", "model_shape", "moe_shape", "read_hf_config"]

MAX_HF_CONFIG_BYTES = 1 << 20


@dataclass(frozen=True)
class Linear:
    name: str  # relative to its block (attn.qkv) or to the model (lm_head)
    fan_in: int
    fan_out: int
    adaptable: bool = True  # an nn.Linear (GPT-2's Conv1D layers are not: LoRA skips them)


@dataclass(frozen=True)
class Shape:
    """What the estimate needs of a model, whichever family builds it."""

    family: str
    n_layer: int
    d_model: int
    n_head: int
    attn_width: int  # n_head * head_dim
    hidden: int  # the MLP's hidden width
    vocab: int
    seq_len: int
    mlp: Literal["gelu", "swiglu"]
    norm: Literal["layernorm", "rmsnorm"]
    block_params: int
    root_params: int  # outside the blocks: embeddings, final norm, an untied head
    block_linears: tuple[Linear, ...]
    head_linears: tuple[Linear, ...]
    block_prefix: str  # "blocks.{}." -- a block linear's full name is prefix + name
    # Per token, what a block keeps for backward besides the linears' inputs: q, k, v and
    # the attention output (SDPA), and the MLP's activation inputs (GELU's, or SwiGLU's
    # w1 output, its silu and w3's output)
    kept_always: int
    # The linears' inputs: (width, the linears reading it); kept only for a linear that
    # trains (its weight's gradient needs it), once per such linear under autocast (each
    # casts its own copy), once in all in fp32
    linear_inputs: tuple[tuple[int, tuple[str, ...]], ...]
    # moe: a block's parameters that one token does not compute with (the experts it is
    # not routed to)
    idle_block_params: int = 0
    # moe: a block's expert weights (what expert parallelism splits over ranks)
    expert_block_params: int = 0

    @property
    def params(self) -> int:
        return self.root_params + self.n_layer * self.block_params

    @property
    def active_params(self) -> int:
        """The parameters one token computes with (all of them but for a moe)."""
        return self.params - self.n_layer * self.idle_block_params

    @property
    def matmul_params(self) -> int:
        """Weights of the linears (a tied head's matrix too): what autocast casts."""
        per_block = sum(x.fan_in * x.fan_out for x in self.block_linears)
        return self.n_layer * per_block + sum(x.fan_in * x.fan_out for x in self.head_linears)


# -- shapes --------------------------------------------------------------------------------


def gpt_shape(c: ModelConfig) -> Shape:
    """trainq's GPT (trainer/model.py): LayerNorm, fused qkv, GELU MLP, biases, tied head."""
    d, h = c.d_model, c.mlp_ratio * c.d_model
    return _gpt_style(
        "gpt",
        d=d,
        layers=c.n_layer,
        heads=c.n_head,
        hidden=h,
        vocab=c.vocab_size,
        positions=c.seq_len,
        seq_len=c.seq_len,
        names=("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"),
        prefix="blocks.{}.",
    )


def _gpt_style(
    family: str,
    *,
    d: int,
    layers: int,
    heads: int,
    hidden: int,
    vocab: int,
    positions: int,
    seq_len: int,
    names: tuple[str, ...],
    prefix: str,
    adaptable: bool = True,
) -> Shape:
    """LayerNorms, a fused qkv, a GELU MLP, biases everywhere, the head tied to the token
    embedding: trainq's GPT and Hugging Face's GPT-2. ``names``: qkv, proj, fc, mlp proj."""
    sizes = ((d, 3 * d), (d, d), (d, hidden), (hidden, d))
    linears = tuple(Linear(n, i, o, adaptable) for n, (i, o) in zip(names, sizes, strict=True))
    biases = sum(o for _, o in sizes)
    return Shape(
        family=family,
        n_layer=layers,
        d_model=d,
        n_head=heads,
        attn_width=d,
        hidden=hidden,
        vocab=vocab,
        seq_len=seq_len,
        mlp="gelu",
        norm="layernorm",
        block_params=2 * 2 * d + sum(x.fan_in * x.fan_out for x in linears) + biases,
        root_params=vocab * d + positions * d + 2 * d,  # embeddings and the final norm
        block_linears=linears,
        head_linears=(Linear("lm_head", d, vocab),),
        block_prefix=prefix,
        kept_always=4 * d + hidden,
        linear_inputs=tuple((i, (n,)) for n, (i, _) in zip(names, sizes, strict=True)),
    )


def _llama_style(
    family: str,
    *,
    d: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    hidden: int,
    vocab: int,
    seq_len: int,
    tied: bool,
    names: tuple[str, ...],
    head: str,
    prefix: str,
    native_gqa: bool,
    extra_block: int = 0,
) -> Shape:
    """RMSNorm, grouped-query attention, SwiGLU, no biases: trainq's llama and Hugging Face's
    LlamaForCausalLM and its kin. ``names``: q, k, v, o, then the MLP's w1, w2, w3.
    ``native_gqa``: SDPA gets k and v at their own width (``enable_gqa``), not repeated."""
    q, kv = heads * head_dim, kv_heads * head_dim
    kv_kept = kv if native_gqa else q
    sizes = ((d, q), (d, kv), (d, kv), (q, d), (d, hidden), (hidden, d), (d, hidden))
    linears = tuple(Linear(n, i, o) for n, (i, o) in zip(names, sizes, strict=True))
    return Shape(
        family=family,
        n_layer=layers,
        d_model=d,
        n_head=heads,
        attn_width=q,
        hidden=hidden,
        vocab=vocab,
        seq_len=seq_len,
        mlp="swiglu",
        norm="rmsnorm",
        block_params=2 * d + sum(x.fan_in * x.fan_out for x in linears) + extra_block,
        root_params=vocab * d + d + (0 if tied else vocab * d),
        block_linears=linears,
        head_linears=(Linear(head, d, vocab),),
        block_prefix=prefix,
        kept_always=2 * q + 2 * kv_kept + 3 * hidden,
        linear_inputs=(
            (d, names[:3]),  # the attention norm's output: q, k, v
            (q, names[3:4]),  # the attention's output: o
            (d, (names[4], names[6])),  # the MLP norm's output: w1, w3
            (hidden, names[5:6]),  # silu(w1 x) * w3 x: w2
        ),
    )


def llama_shape(c: LlamaConfig) -> Shape:
    """trainq's llama (trainer/llama.py)."""
    return _llama_style(
        "llama",
        d=c.d_model,
        layers=c.n_layer,
        heads=c.n_head,
        kv_heads=c.kv_heads,
        head_dim=c.d_model // c.n_head,
        hidden=c.hidden,
        vocab=c.vocab_size,
        seq_len=c.seq_len,
        tied=c.tie_embeddings,
        names=(*(f"attention.w{x}" for x in "qkvo"), *(f"feed_forward.w{x}" for x in "123")),
        head="output",
        prefix="blocks.{}.",
        native_gqa=True,  # trainer/llama.py: enable_gqa
    )


def moe_shape(c: MoeConfig) -> Shape:
    """trainq's moe (trainer/moe.py): the llama's attention; per block a router and
    ``n_experts`` SwiGLU experts, each token's rows copied to ``top_k`` of them. The experts
    are not ``nn.Linear`` layers (LoRA leaves them); listed once each, ``n_experts`` wide."""
    dense = llama_shape(c)
    d, h, e, k = c.d_model, c.hidden, c.n_experts, c.top_k
    attention = dense.block_linears[:4]
    experts = tuple(
        Linear(f"feed_forward.{n}", i, o * e, adaptable=False)
        for n, (i, o) in (("w1", (d, h)), ("w2", (h, d)), ("w3", (d, h)))
    )
    linears = (*attention, Linear("feed_forward.router", d, e), *experts)
    q, kv = dense.attn_width, c.kv_heads * (d // c.n_head)
    return replace(
        dense,
        family="moe",
        block_params=2 * d + sum(x.fan_in * x.fan_out for x in linears),
        block_linears=linears,
        # per token: q, k, v, attention out; the router's probabilities; per copy of the
        # token (top_k): the experts' w1/w3 outputs and silu, and the weighted output
        kept_always=2 * q + 2 * kv + e + k * (3 * h + d),
        linear_inputs=(
            (d, tuple(x.name for x in attention[:3])),
            (q, (attention[3].name,)),
            (d, ("feed_forward.router",)),
            (k * d, ("feed_forward.w1", "feed_forward.w3")),  # the rows sorted by expert
            (k * h, ("feed_forward.w2",)),
        ),
        idle_block_params=3 * d * h * (e - k),
        expert_block_params=3 * d * h * e,
    )


def _positive(cfg: dict[str, Any], key: str, default: int | None = None) -> int:
    value = cfg.get(key)
    if value is None:
        value = default
    if value is None:
        raise ValueError(f"config.json has no {key}")
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"config.json's {key} is not a positive integer")
    return value


def hf_shape(cfg: dict[str, Any], seq_len: int) -> tuple[Shape, str | None]:
    """The model of a Hugging Face config.json (GPT-2, or Llama-style: llama, mistral,
    qwen2, qwen3 exactly, any other with the same keys approximately); ValueError if neither.
    The note says when the count is approximate."""
    kind = str(cfg.get("model_type", "?"))
    if kind == "gpt2":
        d = _positive(cfg, "n_embd")
        shape = _gpt_style(
            "hf",
            d=d,
            layers=_positive(cfg, "n_layer"),
            heads=_positive(cfg, "n_head"),
            hidden=_positive(cfg, "n_inner", 4 * d),
            vocab=_positive(cfg, "vocab_size"),
            positions=_positive(cfg, "n_positions"),
            seq_len=seq_len,
            names=("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"),
            prefix="transformer.h.{}.",
            adaptable=False,  # Conv1D
        )
        return shape, None
    d, heads = _positive(cfg, "hidden_size"), _positive(cfg, "num_attention_heads")
    head_dim = _positive(cfg, "head_dim", d // heads or None)
    kv_heads = _positive(cfg, "num_key_value_heads", heads)
    hidden = _positive(cfg, "intermediate_size")
    extra = 0
    if kind == "qwen2" or cfg.get("attention_bias") is True:  # q, k, v (and o) biases
        extra += (heads + 2 * kv_heads) * head_dim + (d if cfg.get("attention_bias") else 0)
    if cfg.get("mlp_bias") is True:
        extra += 2 * hidden + d
    if kind == "qwen3":
        extra += 2 * head_dim  # q_norm, k_norm
    shape = _llama_style(
        "hf",
        d=d,
        layers=_positive(cfg, "num_hidden_layers"),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        hidden=hidden,
        vocab=_positive(cfg, "vocab_size"),
        seq_len=seq_len,
        tied=cfg.get("tie_word_embeddings", True) is True,  # PretrainedConfig's default
        names=(
            *(f"self_attn.{x}_proj" for x in "qkvo"),
            *(f"mlp.{x}_proj" for x in ("gate", "down", "up")),
        ),
        head="lm_head",
        prefix="model.layers.{}.",
        native_gqa=False,  # transformers' repeat_kv, unless its SDPA path takes enable_gqa
        extra_block=extra,
    )
    exact = kind in ("llama", "mistral", "qwen2", "qwen3")
    return shape, None if exact else f"model_type {kind!r} counted as a Llama-style decoder"


def read_hf_config(path: str, data_root: str | os.PathLike[str] | None) -> dict[str, Any]:
    """``config.json`` of the ``hf`` folder under the data root; ValueError says why not."""
    if data_root is None:
        raise ValueError("no data root is known here to read config.json from")
    try:
        file = resolve_data_path(path, data_root, field="model.path") / "config.json"
        raw = read_plain(file, limit=MAX_HF_CONFIG_BYTES + 1)
    except NotPlainFile as exc:
        raise ValueError(f"{path}/config.json {exc.strerror}") from None
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
    except OSError as exc:
        raise ValueError(f"cannot read {path}/config.json: {exc.strerror or exc}") from None
    if len(raw) > MAX_HF_CONFIG_BYTES:
        raise ValueError(f"{path}/config.json is larger than {MAX_HF_CONFIG_BYTES} bytes")
    try:
        cfg = json.loads(raw)
    except ValueError:
        raise ValueError(f"{path}/config.json is not JSON") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}/config.json is not a JSON object")
    return cfg


def model_shape(
    train: TrainConfig, data_root: str | os.PathLike[str] | None = None
) -> tuple[Shape | None, list[str]]:
    """The shape of the spec's model, and notes; None when a hf config cannot be read."""
    m = train.model
    if isinstance(m, MoeConfig):
        return moe_shape(m), []
    if isinstance(m, LlamaConfig):
        return llama_shape(m), []
    if isinstance(m, HFModelConfig):
        try:
            shape, note = hf_shape(read_hf_config(m.path, data_root), m.seq_len)
        except ValueError as exc:
            return None, [f"parameters unknown: {exc}"]
        return shape, [note] if note else []
    return gpt_shape(m), []
