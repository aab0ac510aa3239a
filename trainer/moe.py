"""The ``moe`` family: trainq's Llama (trainer.llama) with each block's feed-forward replaced
by ``n_experts`` SwiGLU experts and a top-k router, Mixtral's design, so its weights are
transformers' ``MixtralForCausalLM``'s (trainer.hf_io) and it computes the same function.

Routing (as Mixtral): softmax over the router's logits, the ``top_k`` largest kept and
renormalized to sum to 1 (the softmax over the top-k logits). Dropless: every token reaches
its ``top_k`` experts, whatever their load (no capacity factor).

The experts are computed grouped, not token by token nor expert by expert with a search:
the token copies are sorted by expert once (a stable argsort), each expert's rows are then
one contiguous slice, and the experts' weights ``[E, out, in]`` are applied to their slices
by one grouped matmul (``torch._grouped_mm`` where this torch has it, else a matmul per
slice); the results go back to their tokens, weighted, by one ``index_add``. ``loop``
computes the same the way transformers does (``torch.where`` per expert), for tests and
``bench/moe.py``.

The load-balancing loss is transformers' ``load_balancing_loss_func``: over every layer's
tokens together, ``E * sum_e f_e * P_e`` with ``f_e`` the share of top-k assignments to
expert e and ``P_e`` its mean router probability (``top_k`` when perfectly balanced).
ST-MoE's z-loss is the mean squared log-sum-exp of the router logits, over layers and tokens.
Each forward leaves its layers' router statistics on the model (`RouterStats`); the trainer
adds `MoE.router_loss` to the loss and reports `router_metrics`.

Like every model here it knows nothing of processes (no ``torch.distributed``): DDP and FSDP2
(each block one unit, its experts inside) apply from outside, as for the dense families, and
so does expert parallelism, through one hook: `MoEFeedForward.dispatch`, what runs the
experts on the sorted rows (trainer.parallelize.apply_ep sets it; None: all are local).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from trainer.config import MoeConfig
from trainer.llama import INIT_STD, Attention, Llama, LlamaBlock

__all__ = [
    "Dispatch",
    "GroupedLinear",
    "MoE",
    "MoEBlock",
    "MoEFeedForward",
    "RouterStats",
    "load_metrics",
]

# torch._grouped_mm: one kernel for every expert's matmul; older torch: one matmul per slice.
_HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")


@dataclass
class RouterStats:
    """One layer's routing in one forward: top-k assignments per expert ``[E]`` (no grad),
    the router probabilities summed over tokens ``[E]`` and the squared log-sum-exp summed
    over tokens (both with grad, for the losses), and the tokens routed."""

    counts: torch.Tensor
    prob_sum: torch.Tensor
    z_sum: torch.Tensor
    tokens: int


class Dispatch(Protocol):
    """Expert parallelism's hook: ``rows`` ``[N*top_k, d]`` sorted by expert with
    ``counts`` ``[E]`` per expert in; the experts' outputs for those rows, in that order, out
    (``local`` computes this rank's experts on rows sorted by its experts)."""

    def __call__(
        self,
        rows: torch.Tensor,
        counts: torch.Tensor,
        local: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor: ...


class GroupedLinear(nn.Module):
    """``n`` linears without bias, stacked: ``weight`` ``[n, out, in]`` (each ``nn.Linear``'s
    layout), applied to rows sorted by expert."""

    def __init__(self, n: int, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n, out_features, in_features))

    def forward(self, x: torch.Tensor, counts: list[int], offsets: torch.Tensor) -> torch.Tensor:
        """``x`` ``[rows, in]`` sorted by expert, ``counts[e]`` rows for expert e (``offsets``
        their cumulative ends, int32): ``[rows, out]``."""
        w = self.weight.to(x.dtype)
        # CUDA's grouped kernel takes bf16 only; the CPU's any float type
        if _HAS_GROUPED_MM and (x.device.type == "cpu" or x.dtype == torch.bfloat16):
            return torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)
        return torch.cat([F.linear(part, w[e]) for e, part in enumerate(x.split(counts))])


class MoEFeedForward(nn.Module):
    """The router and the experts of one block (transformers' ``MixtralSparseMoeBlock``)."""

    def __init__(self, cfg: MoeConfig) -> None:
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.w1 = GroupedLinear(cfg.n_experts, cfg.d_model, cfg.hidden)  # gate
        self.w2 = GroupedLinear(cfg.n_experts, cfg.hidden, cfg.d_model)  # down
        self.w3 = GroupedLinear(cfg.n_experts, cfg.d_model, cfg.hidden)  # up
        self.grouped = True  # False: transformers' expert loop (tests, bench/moe.py)
        self.stats: RouterStats | None = None
        # Set from outside (trainer.parallelize.apply_ep): what runs the experts on the rows
        # sorted by expert, given the counts per expert and `experts` for the local ones;
        # None: they are all here.
        self.dispatch: Dispatch | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Router logits ``[N, E]``, the top-k weights (fp32, summing to 1) and experts."""
        logits = self.router(x)
        probs = logits.float().softmax(dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        counts = torch.bincount(experts.reshape(-1), minlength=self.n_experts)
        self.stats = RouterStats(
            counts=counts.detach().float(),
            prob_sum=probs.sum(dim=0),
            z_sum=torch.logsumexp(logits.float(), dim=-1).square().sum(),
            tokens=x.shape[0],
        )
        return logits, weights, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        _, weights, experts = self.route(flat)
        if not self.grouped:
            return self._loop(flat, weights, experts).view(shape)
        assert self.stats is not None
        order = experts.reshape(-1).argsort(stable=True)  # token copies, grouped by expert
        token = order // self.top_k
        counts = self.stats.counts.long()
        rows = flat[token]
        if self.dispatch is None:
            out = self.experts(rows, counts)
        else:
            out = self.dispatch(rows, counts, self.experts)
        y = out * weights.reshape(-1)[order, None]
        return torch.zeros_like(flat, dtype=y.dtype).index_add_(0, token, y).to(x.dtype).view(shape)

    def experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The SwiGLU of the experts this module holds, on ``rows`` sorted by expert
        (``counts[e]`` rows for its e-th expert): one grouped matmul per weight."""
        offsets = counts.cumsum(0).to(torch.int32)
        sizes = counts.tolist()
        h = F.silu(self.w1(rows, sizes, offsets)) * self.w3(rows, sizes, offsets)
        return self.w2(h, sizes, offsets)

    def _loop(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """transformers' way: per expert, find its tokens, compute, add back."""
        out = torch.zeros_like(x, dtype=torch.promote_types(x.dtype, weights.dtype))
        for e in range(self.n_experts):
            token, slot = torch.where(experts == e)
            if token.numel() == 0:
                continue
            rows = x[token]
            h = F.silu(F.linear(rows, self.w1.weight[e])) * F.linear(rows, self.w3.weight[e])
            y = F.linear(h, self.w2.weight[e]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out.to(x.dtype)


class MoEBlock(LlamaBlock):
    """A llama block whose feed-forward is the experts (the unit FSDP shards, AC wraps)."""

    def __init__(self, cfg: MoeConfig) -> None:
        nn.Module.__init__(self)
        self.attention_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.feed_forward = MoEFeedForward(cfg)  # type: ignore[assignment]


class MoE(Llama):
    """The sparse decoder; ``num_params`` counts every expert, `active_params` those a token
    uses (``flops_per_token`` counts these)."""

    block_class = MoEBlock
    cfg: MoeConfig

    def __init__(self, cfg: MoeConfig) -> None:
        super().__init__(cfg)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Llama's draw, then the experts': Normal(0, 0.02), w2 (residual) scaled by
        1/sqrt(2 * n_layer) as llama's; the router at 0.02."""
        super().init_weights()
        residual_std = INIT_STD / math.sqrt(2 * self.cfg.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, GroupedLinear):
                std = residual_std if name.endswith(".w2") else INIT_STD
                nn.init.normal_(module.weight, mean=0.0, std=std)

    def _moe_layers(self) -> list[MoEFeedForward]:
        return [m for m in self.modules() if isinstance(m, MoEFeedForward)]

    def layer_stats(self) -> list[RouterStats]:
        """The router statistics of the last forward, per layer."""
        return [m.stats for m in self._moe_layers() if m.stats is not None]

    def set_grouped(self, grouped: bool) -> None:
        for m in self._moe_layers():
            m.grouped = grouped

    def router_counts(self) -> torch.Tensor:
        """The last forward's top-k assignments per layer and expert ``[L, E]`` (no grad)."""
        return torch.stack([s.counts for s in self.layer_stats()])

    def aux_losses(self, counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(load-balancing loss, z-loss) of the last forward, unweighted (module docstring).

        ``counts``: the assignments of the whole micro-batch, every rank's summed
        (`router_counts` all-reduced), from which the balance ``f`` is taken; ``P`` stays
        this rank's mean. Each rank's loss is then a term whose mean over the ranks (what DDP
        and FSDP average the gradients by) is the loss of the whole micro-batch in one
        process: the objective does not depend on how a batch is split over ranks."""
        stats = self.layer_stats()
        assert stats, "no forward has run"
        counts = self.router_counts() if counts is None else counts
        rows = float(sum(s.tokens for s in stats))
        f = counts.sum(0) * self.cfg.top_k / counts.sum()
        p = torch.stack([s.prob_sum for s in stats]).sum(0) / rows
        aux = self.cfg.n_experts * (f.to(p) * p).sum()
        z = torch.stack([s.z_sum for s in stats]).sum() / rows
        return aux, z

    def router_loss(self, counts: torch.Tensor | None = None) -> torch.Tensor:
        """What the router adds to the last forward's loss: the coefficients' weighted sum
        (``counts``: as `aux_losses`)."""
        aux, z = self.aux_losses(counts)
        return self.cfg.aux_loss_coef * aux + self.cfg.router_z_loss_coef * z

    def router_metrics(self, counts: torch.Tensor | None = None) -> torch.Tensor:
        """The last forward's statistics as one fp32 vector, to sum over micro-batches and
        ranks: [aux, z, then this rank's top-k counts per layer and expert]; `load_metrics`
        reads it."""
        aux, z = self.aux_losses(counts)
        local = self.router_counts().reshape(-1)
        return torch.cat([torch.stack([aux.detach(), z.detach()]).float(), local.float()])

    def expert_params(self) -> int:
        """Parameters of the experts, all layers."""
        return sum(m.weight.numel() for m in self.modules() if isinstance(m, GroupedLinear))

    def active_params(self, exclude_embedding: bool = False) -> int:
        """Parameters a token computes with: all but the experts it is not routed to."""
        idle = self.expert_params() * (self.cfg.n_experts - self.cfg.top_k) // self.cfg.n_experts
        return self.num_params(exclude_embedding) - idle

    def flops_per_token(self) -> int:
        """Llama's count over the active parameters (the router's matmul included)."""
        c = self.cfg
        n = self.active_params(exclude_embedding=True)
        if c.tie_embeddings:
            n += self.tok_embeddings.weight.numel()
        return 6 * n + 12 * c.n_layer * c.n_head * (c.d_model // c.n_head) * c.seq_len


def load_metrics(summed: list[float], n_experts: int, count: int) -> dict[str, float]:
    """The metrics of `MoE.router_metrics` vectors summed over ``count`` forwards (micro-
    batches times ranks): the mean ``aux_loss`` and ``router_z_loss``; ``expert_load_max``,
    the share of top-k assignments on the busiest expert of the most unbalanced layer
    (1/E when balanced, 1/top_k when collapsed); ``expert_load_cv``, the coefficient of
    variation of the experts' loads, the mean over layers (0 when balanced)."""
    aux, z, counts = summed[0] / count, summed[1] / count, summed[2:]
    layers = [counts[i : i + n_experts] for i in range(0, len(counts), n_experts)]
    shares, cvs = [], []
    for load in layers:
        total = sum(load) or 1.0
        mean = total / n_experts
        shares.append(max(load) / total)
        cvs.append(math.sqrt(sum((c - mean) ** 2 for c in load) / n_experts) / mean)
    return {
        "aux_loss": aux,
        "router_z_loss": z,
        "expert_load_max": max(shares),
        "expert_load_cv": sum(cvs) / len(cvs),
    }
