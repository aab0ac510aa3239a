"""A dry-run plan of a training spec: parameters, tokens per step and memory per device.

Pure arithmetic on the config: this module imports ``trainer.config`` and the standard
library only (no torch, no transformers), so the API answers ``POST /v1/jobs?dry_run=true``
without loading either. A ``hf`` model's shape comes from its ``config.json`` (read as JSON)
under the data root; without it the plan says so instead of failing.

Memory is estimated per device (one rank) in bytes, one function per term. Notation: ``s``
tokens of one micro-batch (micro_batch_size * seq_len), ``d`` d_model, ``q`` the attention
width (n_head * head_dim; d for gpt and llama), ``h`` the MLP's hidden width, ``V`` the vocab,
``L`` the blocks, ``H`` the heads, ``a`` the bytes of a compute activation (4 fp32, 2 under
bf16/fp16 autocast), ``p`` the bytes of an FSDP-gathered parameter (2 bf16, else 4), ``P``
all parameters, ``T`` the trainable ones, ``W`` the world size.

- weights: ddp ``4P``, plus under autocast the cached half copies of the matmul weights
  (``2 * matmul params``: autocast keeps fp32 weights and casts each once per forward);
  fsdp ``4P/W`` (the fp32 shards; MixedPrecisionPolicy keeps fp32 master weights).
- gathered (fsdp): ``p * (root + k * block)``: the root (embeddings, final norm, untied head)
  stays gathered from forward to backward; ``k = 2`` blocks (the one computing and the next,
  prefetched) with reshard_after_forward, else ``k = L`` (every block kept from its forward).
- gradients: kept (param.grad, ``4T``; fsdp its shards, ``4T/W``) plus buffers: ddp's
  buckets, ``4T`` (the service always runs under torchrun, so DDP wraps even one rank); fsdp
  one block's (or the root's) unsharded gradients before their reduce-scatter,
  ``(p + 4) * that block's T`` (the grads in the parameter dtype, the fp32 scatter input).
- optimizer: AdamW's two fp32 moments of the trainable parameters, ``8T`` (fsdp ``8T/W``).
- optimizer_step: the step's temporaries, ``4T`` (``4T/W``): foreach AdamW (torch's default
  on CUDA) builds sqrt(v) for a whole parameter group.
- activations, per micro-batch (gradient accumulation runs them one after another). SDPA keeps
  no ``T x T`` matrix, only the softmax's logsumexp (``4*s*H``). One block keeps

      gpt:   s * (4*2d         + a*(2d + 5q      + 2h)) + 4*s*H
      llama: s * (4*2d + 4*2d  + a*(2d + 3q + 2k + 4h)) + 4*s*H

  ``4*2d``: the fp32 residual stream into each of the two norms; ``2d``: the norms' outputs,
  the inputs of the next linears; ``3q + 2k``: q, k, v, the attention output and its
  contiguous copy (wo's input), ``k`` the key/value width: n_kv_head * head_dim for trainq's
  llama (SDPA's enable_gqa keeps them unrepeated), q for gpt and, conservatively, for hf
  (transformers repeats them unless its SDPA path takes enable_gqa); gpt's ``2h``: the MLP's
  pre- and post-GELU; llama's ``4h``: SwiGLU's w1 output, its silu, w3's output and their
  product; llama's second ``4*2d``: torch's composite ``rms_norm`` also keeps each norm's
  normalized input in fp32. A linear's input is kept for its weight's gradient, so under
  autocast each linear keeps its own half copy (llama's norm outputs: 3 for wq/wk/wv, 2 for
  w1/w3: ``5d`` instead of ``2d``), and a frozen linear keeps none. With LoRA only the
  adapted linears train: each keeps its input (and, with lora.dropout, its own dropped copy
  and a one-byte mask) and ``x A^T`` (``a*rank``). A checkpointed block keeps only its
  input, ``4*s*d``. The head keeps the final norm's input (``4*s*d``, llama ``8*s*d``) and
  output (``a*s*d``, if the head trains) and, for the loss, ``3 * 4*s*V``: the fp32
  log-probabilities kept for backward and, when backward starts, the gradients of the
  log-probabilities and of the logits beside them.

      none:      L * block + head
      full:      L * 4*s*d + max(head, block)
      selective: ceil(L/2) * 4*s*d + floor(L/2) * block + max(head, block)

  (a checkpointed block is recomputed, one at a time, only after the head's backward has
  freed the loss's tensors: the two never coexist).

- cpu_offload (fsdp): weights, gradients and optimizer state (the shards) live in host memory;
  the device keeps the gathered parameters, the unsharded gradients and the activations.

total = weights + gathered + optimizer + DDP's buckets + the largest of: backward's start,
activations (+ the kept gradients when grad_accum_steps > 1: earlier micro-batches left
theirs); backward's end, kept + fsdp's unsharded gradients; the step, kept + optimizer_step.
Backward peaks at its start, before it has made any gradient: the activations go as the
gradients come.

Not modelled: torch.compile (its fusions keep less), the CUDA context, NCCL and library
workspaces, allocator fragmentation.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from typing import Any, Literal

from trainer.config import (
    ConfigError,
    HFModelConfig,
    LlamaConfig,
    ModelConfig,
    TrainConfig,
    resolve_data_path,
)

__all__ = ["DEFAULT_LORA_TARGETS", "Shape", "lora_matches", "model_shape", "plan"]

FP32 = 4
# The linears LoRA adapts when the spec names no targets, each family's attention
# projections, and how a name matches a target: trainer.lora's DEFAULT_TARGETS and _matches,
# repeated here because that module imports torch (keep the two the same).
DEFAULT_LORA_TARGETS: dict[str, tuple[str, ...]] = {
    "gpt": ("attn.qkv", "attn.proj"),
    "llama": ("attention.wq", "attention.wk", "attention.wv", "attention.wo"),
    "hf": ("q_proj", "k_proj", "v_proj", "o_proj"),
}


def lora_matches(name: str, targets: tuple[str, ...]) -> bool:
    """A linear's full name is a target or ends with ``.`` + a target."""
    return any(name == t or name.endswith("." + t) for t in targets)


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

    @property
    def params(self) -> int:
        return self.root_params + self.n_layer * self.block_params

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
        file = resolve_data_path(path, data_root) / "config.json"
        with open(file, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise ValueError(f"{path}/config.json is not a regular file")
            raw = f.read(MAX_HF_CONFIG_BYTES + 1)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
    except OSError as exc:
        raise ValueError(f"cannot read {path}/config.json: {exc.strerror or exc}") from None
    if len(raw) > MAX_HF_CONFIG_BYTES:
        raise ValueError(f"{path}/config.json is larger than {MAX_HF_CONFIG_BYTES} bytes")
    try:
        cfg = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"{path}/config.json is not JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}/config.json is not a JSON object")
    return cfg


def model_shape(
    train: TrainConfig, data_root: str | os.PathLike[str] | None = None
) -> tuple[Shape | None, list[str]]:
    """The shape of the spec's model, and notes; None when a hf config cannot be read."""
    m = train.model
    if isinstance(m, LlamaConfig):
        return llama_shape(m), []
    if isinstance(m, HFModelConfig):
        try:
            shape, note = hf_shape(read_hf_config(m.path, data_root), m.seq_len)
        except ValueError as exc:
            return None, [f"parameters unknown: {exc}"]
        return shape, [note] if note else []
    return gpt_shape(m), []


# -- parameters ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Counts:
    total: int  # every parameter, LoRA's adapters included
    trainable: int
    block: int  # the largest block's parameters (adapters included): FSDP gathers it whole
    block_trainable: int  # ... and its trainable ones (its unsharded gradients)
    root: int  # outside the blocks (FSDP's root), adapters included
    root_trainable: int
    # LoRA: the linears adapted in that largest block, and whether the head is; None: all
    # parameters train
    adapted: frozenset[str] | None = None
    head_adapted: bool = True


def adapted(linears: tuple[Linear, ...], prefix: str, targets: tuple[str, ...]) -> list[Linear]:
    """The linears LoRA adapts (trainer.lora.apply_lora): each nn.Linear whose full name
    (``prefix`` + its name) a target names."""
    return [x for x in linears if x.adaptable and lora_matches(prefix + x.name, targets)]


def adapter_params(linears: list[Linear], rank: int) -> int:
    """``rank * (in + out)`` per adapted linear: LoRA's A and B."""
    return sum(rank * (x.fan_in + x.fan_out) for x in linears)


def parameter_counts(shape: Shape, train: TrainConfig) -> Counts:
    if train.lora is None:
        return Counts(
            total=shape.params,
            trainable=shape.params,
            block=shape.block_params,
            block_trainable=shape.block_params,
            root=shape.root_params,
            root_trainable=shape.root_params,
        )
    targets = tuple(train.lora.targets or DEFAULT_LORA_TARGETS[shape.family])
    rank = train.lora.rank
    blocks = [
        adapted(shape.block_linears, shape.block_prefix.format(i), targets)
        for i in range(shape.n_layer)
    ]
    per_block = [adapter_params(b, rank) for b in blocks]
    largest = max(range(shape.n_layer), key=per_block.__getitem__)
    head = adapter_params(adapted(shape.head_linears, "", targets), rank)
    return Counts(
        total=shape.params + sum(per_block) + head,
        trainable=sum(per_block) + head,
        block=shape.block_params + per_block[largest],
        block_trainable=per_block[largest],
        root=shape.root_params + head,
        root_trainable=head,
        adapted=frozenset(x.name for x in blocks[largest]),
        head_adapted=head > 0,
    )


# -- memory terms (bytes per device) ---------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """The choices of the spec that the memory terms depend on."""

    shape: Shape
    counts: Counts
    tokens: int  # s: one micro-batch's tokens
    world: int
    fsdp: bool
    offload: bool
    half: bool  # bf16 / fp16 autocast
    reshard: bool
    ac: str
    accum: int  # micro-batches per step
    lora_rank: int = 0
    lora_dropout: bool = False

    @property
    def act_bytes(self) -> int:
        return 2 if self.half else FP32

    @property
    def gathered_param_bytes(self) -> int:
        return 2 if self.fsdp and self.half else FP32

    def shard(self, n: int) -> int:
        return -(-n // self.world) if self.fsdp else n

    def trains(self, linear: str) -> bool:
        """Whether a block linear has a trainable weight (all do, or LoRA adapts it)."""
        return self.counts.adapted is None or linear in self.counts.adapted


def weights(r: Run) -> int:
    """ddp: 4P, plus autocast's half copies of the matmul weights; fsdp: the fp32 shards."""
    if r.fsdp:
        return 0 if r.offload else FP32 * r.shard(r.counts.total)
    cast_copies = 2 * r.shape.matmul_params if r.half else 0
    return FP32 * r.counts.total + cast_copies


def gathered(r: Run) -> int:
    """fsdp: the root and the blocks gathered at once, in the parameter dtype."""
    if not r.fsdp:
        return 0
    blocks = min(2, r.shape.n_layer) if r.reshard else r.shape.n_layer
    return r.gathered_param_bytes * (r.counts.root + blocks * r.counts.block)


def gradients(r: Run) -> int:
    """Every gradient there is at the end of backward."""
    return kept_gradients(r) + ddp_buckets(r) + unsharded_gradients(r)


def kept_gradients(r: Run) -> int:
    """The gradients the optimizer steps with: param.grad (ddp) or its shards (fsdp)."""
    if r.fsdp and r.offload:
        return 0
    return FP32 * r.shard(r.counts.trainable)


def ddp_buckets(r: Run) -> int:
    """DDP's gradient buckets: a copy of every gradient, made once and always there."""
    return 0 if r.fsdp else FP32 * r.counts.trainable


def unsharded_gradients(r: Run) -> int:
    """fsdp: one block's (or the root's, reduced last) gradients before their
    reduce-scatter, in the parameter dtype and as the fp32 scatter input."""
    if not r.fsdp:
        return 0
    largest = max(r.counts.block_trainable, r.counts.root_trainable)
    return (r.gathered_param_bytes + FP32) * largest


def optimizer(r: Run) -> int:
    """AdamW's exp_avg and exp_avg_sq, fp32, of the trainable parameters (or their shards)."""
    return 0 if r.offload else 2 * FP32 * r.shard(r.counts.trainable)


def optimizer_step(r: Run) -> int:
    """foreach AdamW's sqrt(exp_avg_sq) for the whole group, made and freed in the step."""
    return 0 if r.offload else FP32 * r.shard(r.counts.trainable)


def block_activations(r: Run) -> int:
    """What one block keeps for backward (the module docstring's gpt and llama lines)."""
    sh, a = r.shape, r.act_bytes
    residual = FP32 * 2 * sh.d_model * (2 if sh.norm == "rmsnorm" else 1)
    adapted = len(r.counts.adapted or ())  # each keeps x A^T (rank wide) for B
    per_token = residual + a * (sh.kept_always + r.lora_rank * adapted) + FP32 * sh.n_head
    return r.tokens * (per_token + linear_inputs(r))


def linear_inputs(r: Run) -> int:
    """Per token, the inputs a block's linears keep: only a linear that trains keeps its
    input; under autocast each keeps its own half copy, in fp32 they share the tensor
    (LoRA's dropout gives each adapter its own, and a one-byte mask)."""
    per_token = 0
    for width, readers in r.shape.linear_inputs:
        keeping = sum(1 for name in readers if r.trains(name))
        copies = keeping if r.half or r.lora_dropout else min(1, keeping)
        per_token += width * (copies * r.act_bytes + (keeping if r.lora_dropout else 0))
    return per_token


def head_activations(r: Run) -> int:
    """The final norm's tensors and the loss's three ``s x V`` fp32 tensors."""
    sh = r.shape
    norm = FP32 * sh.d_model * (2 if sh.norm == "rmsnorm" else 1)
    norm += r.act_bytes * sh.d_model if r.counts.head_adapted else 0  # the head's input
    loss = 3 * FP32 * sh.vocab
    return r.tokens * (norm + loss)


def activations(r: Run) -> int:
    """One micro-batch's, at the start of backward, for the activation checkpointing."""
    layers, block = r.shape.n_layer, block_activations(r)
    kept_input = FP32 * r.tokens * r.shape.d_model
    head = head_activations(r)
    if r.ac == "full":
        return layers * kept_input + max(head, block)
    if r.ac == "selective":  # trainer.parallelize.apply_ac: blocks 0, 2, 4, ...
        checkpointed = (layers + 1) // 2
        kept = checkpointed * kept_input + (layers - checkpointed) * block
        return kept + max(head, block)
    return layers * block + head


def host_offloaded(r: Run) -> dict[str, int]:
    """What cpu_offload moves to host memory (per rank): the shards and their state."""
    if not r.offload:
        return {"weights": 0, "gradients": 0, "optimizer": 0, "total": 0}
    terms = {
        "weights": FP32 * r.shard(r.counts.total),
        "gradients": FP32 * r.shard(r.counts.trainable),
        "optimizer": 2 * FP32 * r.shard(r.counts.trainable),
    }
    return {**terms, "total": sum(terms.values())}


def device_memory(r: Run) -> dict[str, int]:
    terms = {
        "weights": weights(r),
        "gathered": gathered(r),
        "gradients": gradients(r),
        "optimizer": optimizer(r),
        "activations": activations(r),
        "optimizer_step": optimizer_step(r),
    }
    return {**terms, "total": peak(r)}


def peak(r: Run) -> int:
    """What is always there, plus the largest of three moments: backward's start (the
    activations, before any gradient is made, unless earlier micro-batches of the step left
    theirs), backward's end (every gradient, under FSDP the root's still unsharded) and the
    optimizer step (every gradient and the step's temporaries)."""
    always = weights(r) + gathered(r) + optimizer(r) + ddp_buckets(r)
    kept = kept_gradients(r)
    start = activations(r) + (kept if r.accum > 1 else 0)
    end = kept + unsharded_gradients(r)
    step = kept + optimizer_step(r)
    return always + max(start, end, step)


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
    out: dict[str, Any] = {
        "family": train.model.family,
        "world_size": world,
        "tokens_per_step": micro * train.batch.grad_accum_steps * world,
        "parameters": {"total": None, "trainable": None},
        "memory": None,
    }
    total = None
    if shape is not None:
        counts = parameter_counts(shape, train)
        out["parameters"] = {"total": counts.total, "trainable": counts.trainable}
        if train.lora is not None and counts.trainable == 0:
            notes.append("lora.targets match no linear of the model: the trainer refuses it")
        fsdp = train.strategy == "fsdp"
        run = Run(
            shape=shape,
            counts=counts,
            tokens=micro,
            world=world,
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
