"""The data-parallel layout of a run: how its ranks hold the model (torch-free).

``ddp`` replicates the whole model on every rank; ``fsdp`` shards every parameter over all
ranks (one all-gather / reduce-scatter group spanning every node); ``hsdp`` (FSDP2 over a
2-D device mesh, ``fsdp.replicate`` > 1) shards within a group of ``shard`` ranks and
replicates across ``replicate`` groups: the gathers and reduce-scatters stay inside a node,
only a gradient all-reduce (over the shards) crosses nodes, at the price of holding
``world / shard`` times the fully sharded memory. torchrun numbers a node's ranks
consecutively, so the mesh's rows, ``(replicate, shard)`` in row-major order, are the nodes.

Expert parallelism (``expert_parallel`` = N > 1, moe under ddp) splits each layer's experts
over groups of N consecutive ranks; the ``world / N`` groups hold the same experts, so an
expert's gradient is summed across them (trainer.parallelize.apply_ep).

The service (a 422 at submit), the dry-run plan and the trainer all resolve it here.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config import ConfigError, TrainConfig

__all__ = ["Layout", "LayoutError", "layout"]


class LayoutError(ConfigError):
    """A layout the world size does not allow; ``field``: the spec's field, dotted."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Layout:
    strategy: str  # "ddp", "fsdp" or "hsdp" ("single" for one process without torchrun)
    world: int
    replicate: int  # copies of each parameter (ddp: every rank; fsdp: 1)
    expert: int = 1  # the ranks each layer's experts are split over (expert_parallel)

    @property
    def shard(self) -> int:
        """The ranks one parameter is sharded over (1 under ddp)."""
        return self.world // self.replicate

    @property
    def mesh(self) -> tuple[int, int] | None:
        """FSDP2's 2-D device mesh ``(replicate, shard)``; None: a 1-D one (or no FSDP)."""
        return (self.replicate, self.shard) if self.strategy == "hsdp" else None

    def describe(self) -> str:
        if self.strategy == "hsdp":
            return (
                f"hsdp: {self.replicate} replicas x {self.shard} shards (mesh replicate x shard;"
                " parameters sharded within a shard group, gradients all-reduced across)"
            )
        if self.strategy == "fsdp":
            return f"fsdp: parameters sharded over {self.world} rank(s)"
        if self.strategy == "ddp" and self.expert > 1:
            return (
                f"ddp: the model replicated on {self.world} rank(s) but its experts, split over"
                f" groups of {self.expert} (expert parallelism: {self.world // self.expert}"
                " copies of each expert)"
            )
        if self.strategy == "ddp":
            return f"ddp: the model replicated on {self.world} rank(s)"
        return "single: one process"


def layout(train: TrainConfig, world: int, nodes: int) -> Layout:
    """The layout of ``train`` on ``world`` ranks over ``nodes`` nodes; LayoutError naming
    ``fsdp.replicate`` or ``expert_parallel`` when it does not divide the world size."""
    if train.strategy != "fsdp":
        ep = train.expert_parallel
        if world % ep:
            raise LayoutError(
                "expert_parallel",
                f"expert_parallel ({ep}) must divide the world size ({world} ="
                f" nodes {nodes} x procs_per_node {world // max(1, nodes)})",
            )
        return Layout("ddp", world, world, ep)
    wanted = train.fsdp.replicate
    replicate = (nodes if nodes > 1 else 1) if wanted == "auto" else wanted
    if world % replicate:
        raise LayoutError(
            "fsdp.replicate",
            f"fsdp.replicate ({replicate}) must divide the world size ({world} ="
            f" nodes {nodes} x procs_per_node {world // max(1, nodes)})",
        )
    return Layout("hsdp" if replicate > 1 else "fsdp", world, replicate)
