"""The dry-run plan's parameter counts and memory per device (trainer.plan).

Memory is estimated per device (one rank) in bytes, one function per term. Notation: ``s``
tokens of one micro-batch (micro_batch_size * seq_len), ``d`` d_model, ``q`` the attention
width (n_head * head_dim; d for gpt and llama), ``h`` the MLP's hidden width, ``V`` the vocab,
``L`` the blocks, ``H`` the heads, ``a`` the bytes of a compute activation (4 fp32, 2 under
bf16/fp16 autocast), ``p`` the bytes of an FSDP-gathered parameter (2 bf16, else 4), ``P``
all parameters, ``T`` the trainable ones, ``W`` the ranks a parameter is sharded over: the
world size under fsdp, the shard dimension of the mesh under HSDP (``fsdp.replicate`` > 1,
trainer.mesh: each shard group holds a whole copy). Under expert parallelism
(``expert_parallel`` = N, ddp) ``P``, ``T`` and a block's counts are one rank's: its 1/N of
each block's experts (`split_experts`; DDP's buckets leave the experts out too).

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

from dataclasses import dataclass, replace

from trainer.config import DEFAULT_LORA_TARGETS, TrainConfig, lora_matches
from trainer.plan_shape import Linear, Shape

__all__ = [
    "Counts",
    "Run",
    "device_memory",
    "host_offloaded",
    "parameter_counts",
    "peak",
    "split_experts",
]

FP32 = 4


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


def split_experts(counts: Counts, shape: Shape, ep: int) -> Counts:
    """What one rank holds under expert parallelism (``expert_parallel`` = ``ep``): each
    block's experts ``1/ep`` of them; their gradients and AdamW state too when they train
    (LoRA leaves them frozen)."""
    if ep == 1:
        return counts
    gone = shape.expert_block_params - shape.expert_block_params // ep  # per block
    trains = counts.adapted is None
    return replace(
        counts,
        total=counts.total - shape.n_layer * gone,
        trainable=counts.trainable - (shape.n_layer * gone if trains else 0),
        block=counts.block - gone,
        block_trainable=counts.block_trainable - (gone if trains else 0),
    )


# -- memory terms (bytes per device) ---------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """The choices of the spec that the memory terms depend on."""

    shape: Shape
    counts: Counts
    tokens: int  # s: one micro-batch's tokens
    world: int  # W: the ranks a parameter is sharded over (fsdp; HSDP's shard dimension)
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
