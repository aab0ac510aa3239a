"""Processes and parallelism: the process group, DDP, FSDP2, activation checkpointing and
compile, torchtitan's names.

`init_distributed` turns the torchrun environment (read by `trainer.env.read_env`) into a
device and a process group: gloo on CPU, nccl on CUDA with the rank's own device. The
``apply_*`` functions wrap a built model (FSDP's is built on the meta device and
materialized after sharding, torchtitan's order; HSDP is FSDP2 over `build_mesh`'s 2-D
mesh); `maybe_no_sync` is how gradient
accumulation skips the gradient reduction on all but the last micro-step. `apply_ep` splits
a moe's experts over ranks (expert parallelism, docs/architecture.md).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from trainer.env import TrainerEnv
from trainer.moe import MoEFeedForward

__all__ = [
    "ExpertShard",
    "all_reduce_sum",
    "apply_ac",
    "apply_compile",
    "apply_ddp",
    "apply_ep",
    "apply_fsdp",
    "barrier",
    "build_ep_mesh",
    "build_mesh",
    "clip_grad_norm",
    "destroy_distributed",
    "expert_shard",
    "init_distributed",
    "materialize_fsdp",
    "maybe_no_sync",
    "sync_expert_grads",
    "unwrap",
]


def init_distributed(env: TrainerEnv) -> torch.device:
    """The rank's device; joins the process group when launched by torchrun."""
    if torch.cuda.is_available():
        device = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if env.distributed and not dist.is_initialized():
        # device_id binds NCCL's communicator to this rank's GPU eagerly (no guessing later).
        dist.init_process_group(
            backend,
            rank=env.rank,
            world_size=env.world_size,
            device_id=device if device.type == "cuda" else None,
        )
    return device


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` over ranks in place (gloo has no AVG, so callers divide); no-op alone."""
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def _blocks(model: nn.Module) -> nn.ModuleList:
    """The model's repeated blocks: every family keeps them in ``blocks``."""
    blocks = model.blocks
    assert isinstance(blocks, nn.ModuleList), f"{type(model).__name__}.blocks is not a ModuleList"
    return blocks


def apply_ac(model: nn.Module, mode: str) -> None:
    """Activation checkpointing per block (torchtitan's ``apply_ac``), before FSDP and
    compile: a checkpointed block keeps only its input and recomputes its activations in
    backward. ``full``: every block; ``selective``: every second one (about half the
    activation memory saved for about half the recompute); ``none``: nothing.

    The block's own ``forward`` is wrapped in place rather than the block in a wrapper
    module, so parameter names, state dicts and checkpoints are the same either way.
    Non-reentrant checkpointing: it works under FSDP2's hooks and with frozen parameters.
    """
    if mode == "none":
        return
    for i, block in enumerate(_blocks(model)):
        if mode == "full" or i % 2 == 0:
            inner = block.forward

            def forward(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
                return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

            block.forward = forward


def apply_compile(model: nn.Module) -> None:
    """Compile each block in place (before DDP/FSDP wrap them), as torchtitan does."""
    for block in _blocks(model):
        block.compile()


def apply_ddp(model: nn.Module, device: torch.device) -> DDP:
    """DDP with two options off their defaults, for what every family here is:

    - ``gradient_as_bucket_view``: the gradients are views into DDP's reduction buckets,
      not separate tensors copied in before and out after each all-reduce (one copy of
      every gradient less per step, and its memory);
    - no broadcast of the module's buffers from rank 0 before every forward (a collective
      and a sync point per step). The buffers of these models are constants (a
      transformers model's rotary ``inv_freq``; the native families have none), equal on
      every rank, that training does not change (no batch-norm statistics), as FSDP2
      never broadcasts them either.

    The option is ``forward_sync_buffers=False`` where torch has it (it still syncs the
    buffers once, at construction); before, ``broadcast_buffers=False``, which torch now
    deprecates with a FutureWarning that every rank would print at the top of every log.
    """
    ids = [device.index] if device.type == "cuda" else None
    return DDP(model, device_ids=ids, gradient_as_bucket_view=True, **_NO_FORWARD_BUFFER_SYNC)


_NO_FORWARD_BUFFER_SYNC: dict[str, Any] = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
    else {"broadcast_buffers": False}
)


def build_mesh(device: torch.device, shape: tuple[int, int] | None) -> DeviceMesh | None:
    """HSDP's 2-D device mesh ``(replicate, shard)`` (trainer.mesh.Layout.mesh), as
    torchtitan builds its ``dp_replicate x dp_shard`` one; None: FSDP2's default 1-D mesh
    over every rank. Row-major, so a shard group is consecutive ranks: one node's."""
    if shape is None:
        return None
    return init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard"))


@dataclass(frozen=True)
class ExpertShard:
    """Where a rank's slice of the experts sits: the ``group`` of ``size`` ranks the experts
    are split over (this rank is its ``index``-th), the ``replicas`` group of the ranks that
    hold the same slice (None: no other does) and the world size. Set as ``expert_shard`` on
    each sharded parameter (its dim 0 is the experts), for the gradient sum, the gradient
    norm and checkpoints (trainer.checkpoint gathers them whole)."""

    group: dist.ProcessGroup
    replicas: dist.ProcessGroup | None
    index: int
    size: int
    world: int

    def bounds(self, n_experts: int) -> tuple[int, int]:
        """This rank's experts: ``[lo, hi)`` of ``n_experts``."""
        per = n_experts // self.size
        return self.index * per, (self.index + 1) * per


def expert_shard(p: torch.Tensor) -> ExpertShard | None:
    """The `ExpertShard` of a parameter `apply_ep` split; None for every other tensor."""
    return getattr(p, "expert_shard", None)


def build_ep_mesh(device: torch.device, world: int, ep: int) -> DeviceMesh:
    """Expert parallelism's 2-D mesh ``(replicate, expert)``: groups of ``ep`` consecutive
    ranks split the experts; the ``world / ep`` groups replicate them."""
    return init_device_mesh(device.type, (world // ep, ep), mesh_dim_names=("replicate", "expert"))


def apply_ep(model: nn.Module, mesh: DeviceMesh) -> None:
    """Expert parallelism (before DDP): each `MoEFeedForward` keeps only its slice of the
    experts (``mesh``'s ``expert`` dimension: rank r of W holds experts ``r*E/W ..
    (r+1)*E/W-1``, cut from the full, seeded weights) and runs its expert step as
    dispatch -> local experts -> combine (`_AllToAll`). DDP leaves the sliced weights out of
    its reduction; `sync_expert_grads` reduces them instead."""
    replicas = mesh.size(0)
    shard = ExpertShard(
        group=mesh.get_group("expert"),
        replicas=mesh.get_group("replicate") if replicas > 1 else None,
        index=mesh.get_local_rank("expert"),
        size=mesh.size(1),
        world=mesh.size(),
    )
    ignore = []
    for name, module in model.named_modules():
        if not isinstance(module, MoEFeedForward):
            continue
        lo, hi = shard.bounds(module.n_experts)
        for key in ("w1", "w2", "w3"):
            linear = getattr(module, key)
            weight = nn.Parameter(
                linear.weight.detach()[lo:hi].clone(), requires_grad=linear.weight.requires_grad
            )
            weight.expert_shard = shard  # type: ignore[attr-defined]
            linear.weight = weight
            ignore.append(f"{name}.{key}.weight")
        module.dispatch = _AllToAll(shard)
    DDP._set_params_and_buffers_to_ignore_for_model(model, ignore)


class _AllToAll:
    """Dispatch -> local experts -> combine, dropless (torchtitan's and Megatron's).

    The rows come sorted by expert, so by the rank that holds it: one ``all_to_all_single``
    of the counts per expert tells every rank what it receives, one of the rows (autograd-
    aware: the backward is the reverse exchange) sends them. They arrive grouped by source
    rank, then expert; a stable sort groups them by local expert for the grouped matmul, its
    inverse puts the results back and the reverse exchange returns them in the order they
    left."""

    def __init__(self, shard: ExpertShard) -> None:
        self.shard = shard

    def __call__(
        self,
        rows: torch.Tensor,
        counts: torch.Tensor,
        local: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        group, size = self.shard.group, self.shard.size
        per = counts.numel() // size
        received = torch.empty_like(counts)  # [source rank, local expert], flattened
        dist.all_to_all_single(received, counts, group=group)
        send = counts.view(size, per).sum(1).tolist()
        by_source = received.view(size, per)
        recv = by_source.sum(1).tolist()
        arrived = all_to_all_single_autograd(rows, recv, send, group)
        expert = torch.arange(per, device=counts.device).repeat(size)
        order = expert.repeat_interleave(received).argsort(stable=True)
        out = local(arrived[order], by_source.sum(0))
        back = out[order.argsort()]
        return all_to_all_single_autograd(back, send, recv, group)


def sync_expert_grads(model: nn.Module) -> None:
    """The sliced experts' gradients (`apply_ep`), after the step's backward: summed over the
    ranks that hold the same slice and divided by the world size, the average DDP gives the
    other parameters (each rank's loss carries a factor of the world size, trainer.train).
    Their owner saw every token of its expert group through the exchange, so no reduction
    within the group is needed."""
    for p in model.parameters():
        shard = expert_shard(p)
        if shard is None or p.grad is None:
            continue
        if shard.replicas is not None:
            dist.all_reduce(p.grad, group=shard.replicas)
        p.grad.div_(shard.world)


def apply_fsdp(
    model: nn.Module,
    param_dtype: torch.dtype | None = None,
    *,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    mesh: DeviceMesh | None = None,
) -> nn.Module:
    """FSDP2: shard each block, then the root (embeddings, final norm, tied head).

    With a 2-D ``mesh`` (`build_mesh`) it is HSDP: each parameter is sharded over the mesh's
    ``shard`` dimension and replicated over ``replicate``; FSDP2 reduce-scatters gradients
    within a shard group and all-reduces the shards across the groups.

    With ``param_dtype`` (bf16), parameters are gathered and computed in that dtype while
    the sharded master weights, and the gradient reduction, stay fp32.
    ``reshard_after_forward=False`` keeps each block's gathered parameters from its forward
    to its backward (one all-gather less per block, ZeRO-2's memory). ``cpu_offload`` keeps
    the sharded parameters, their gradients and so the optimizer state in CPU memory and
    copies each block's to the device for its compute (ZeRO-Offload's trade).
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    for block in _blocks(model):
        fully_shard(
            block,
            mesh=mesh,
            mp_policy=mp,
            offload_policy=offload,
            reshard_after_forward=reshard_after_forward,
        )
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload)
    return model


def materialize_fsdp(
    model: nn.Module,
    device: torch.device,
    full: nn.Module | None,
    *,
    cpu_offload: bool = False,
) -> None:
    """Allocate this rank's shards of a model built on the meta device and sharded by
    `apply_fsdp`, then fill them from rank 0's full model (``full``, on the CPU; None on
    the other ranks), broadcast shard by shard. No rank but 0 ever holds the whole model, and
    rank 0 holds it on the CPU only: a model need not fit on one device to start. With CPU
    offload the shards live in CPU memory.

    Buffers are not in a state dict when they are non-persistent (a rotary embedding's
    frequency table, say): ``to_empty`` leaves them uninitialized, so every buffer is
    broadcast from rank 0's model too, whatever the family."""
    model.to_empty(device=torch.device("cpu") if cpu_offload else device)
    if cpu_offload:  # parameters live on the host; buffers are used where compute runs
        for module in model.modules():
            for key, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[key] = buf.to(device)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full.state_dict() if full is not None else {}, options=options)
    sources = dict(full.named_buffers()) if full is not None else {}
    for name, buf in model.named_buffers():
        if full is not None:
            buf.copy_(sources[name])
        dist.broadcast(buf, src=0)


def unwrap(model: nn.Module) -> nn.Module:
    """The model under a DDP wrapper (FSDP2 shards in place, so it is its own module)."""
    return model.module if isinstance(model, DDP) else model


@contextlib.contextmanager
def maybe_no_sync(model: nn.Module, sync: bool) -> Iterator[None]:
    """Skip the gradient all-reduce / reduce-scatter of this backward unless ``sync``."""
    if isinstance(model, DDP) and not sync:
        with model.no_sync():
            yield
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(sync)
        yield
    else:
        yield


def clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """Clip to ``max_norm`` (0: do not clip) and return the global grad norm before clipping.

    Under FSDP the grads are sharded DTensors; clip_grad_norm_ reduces their norms across
    ranks and returns a replicated DTensor, hence ``full_tensor``.
    """
    sharded = [p for p in model.parameters() if p.grad is not None and expert_shard(p)]
    if sharded:
        return _clip_with_experts(model, sharded, max_norm)
    norm = torch.nn.utils.clip_grad_norm_(
        model.parameters(), max_norm if max_norm > 0 else float("inf")
    )
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm.item())


def _clip_with_experts(model: nn.Module, sharded: list[nn.Parameter], max_norm: float) -> float:
    """`clip_grad_norm` under expert parallelism: the squares of the sliced experts' norms
    summed over their group (each slice once), added to the replicated parameters'."""
    shard = expert_shard(sharded[0])
    assert shard is not None
    dense = [p.grad for p in model.parameters() if p.grad is not None and not expert_shard(p)]
    experts = torch.nn.utils.get_total_norm([p.grad for p in sharded if p.grad is not None])
    squares = experts.square().reshape(1)
    dist.all_reduce(squares, group=shard.group)
    total = squares[0]
    if dense:
        total = total + torch.nn.utils.get_total_norm(dense).square()
    norm = total.sqrt()
    if max_norm > 0:
        params = [p for p in model.parameters() if p.grad is not None]
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return float(norm.item())
