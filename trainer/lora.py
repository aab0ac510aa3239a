"""LoRA: low-rank adapters on a model's linears, the base weights frozen.

A targeted ``nn.Linear`` becomes a `LoRALinear` in place (its class is swapped, its
``weight`` and ``bias`` stay the same parameters under the same names) and gains
``lora_a`` ``[rank, in]`` and ``lora_b`` ``[out, rank]``::

    y = x W^T + b + (alpha / rank) * dropout(x) A^T B^T

``lora_b`` starts at zero, so an adapted model computes exactly what its base does until it
trains. Everything but the adapters is frozen.

Why our own module and not ``peft``: the adapters have to live inside our models *and*
transformers' ones, be built on the meta device, sharded by FSDP2 in the same unit as the
frozen weight they adapt (FSDP2 shards per parameter, so frozen and trainable parameters in
one ``fully_shard`` unit are fine; FSDP1's flat parameters were not), checkpointed with
parameter names that do not move, and merged for export. peft wraps modules (renaming
parameters to ``base_layer``), expects transformers' ``PreTrainedModel`` and does its own
initialization on real devices; the ~100 lines here do what trainq needs under all three
families and every strategy.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainer.config import DEFAULT_LORA_TARGETS, LoraConfig, lora_matches

__all__ = [
    "LoRALinear",
    "apply_lora",
    "drop_lora",
    "init_lora",
    "lora_param_count",
    "merge_lora",
    "targets_for",
]


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` with a low-rank update; made from one by `apply_lora`."""

    lora_a: nn.Parameter
    lora_b: nn.Parameter
    scaling: float
    lora_dropout: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = F.linear(x, self.weight, self.bias)
        h = F.dropout(x, self.lora_dropout, self.training) if self.lora_dropout else x
        return base + (h @ self.lora_a.t() @ self.lora_b.t()) * self.scaling


def targets_for(model_cfg: Any, lora: LoraConfig) -> tuple[str, ...]:
    """The spec's targets, or the family's defaults (trainer.config.DEFAULT_LORA_TARGETS)."""
    if lora.targets is not None:
        return tuple(lora.targets)
    return DEFAULT_LORA_TARGETS[model_cfg.family]


def apply_lora(model: nn.Module, lora: LoraConfig, targets: tuple[str, ...]) -> int:
    """Adapt every linear whose name ends with a target, freeze everything else; the number
    of adapted linears. ValueError when no linear matches (a typo in ``targets``)."""
    for p in model.parameters():
        p.requires_grad_(False)
    adapted = 0
    for name, module in model.named_modules():
        if type(module) is not nn.Linear or not lora_matches(name, targets):
            continue
        module.__class__ = LoRALinear
        layer: LoRALinear = module  # type: ignore[assignment]
        out_f, in_f = layer.weight.shape
        device, dtype = layer.weight.device, layer.weight.dtype
        layer.lora_a = nn.Parameter(torch.empty(lora.rank, in_f, device=device, dtype=dtype))
        layer.lora_b = nn.Parameter(torch.empty(out_f, lora.rank, device=device, dtype=dtype))
        layer.scaling = lora.alpha / lora.rank
        layer.lora_dropout = lora.dropout
        adapted += 1
    if not adapted:
        raise ValueError(f"lora.targets {list(targets)} match no linear layer of the model")
    return adapted


@torch.no_grad()
def init_lora(model: nn.Module) -> None:
    """A from the current RNG (Kaiming-uniform, as the paper's code), B at zero."""
    for module in model.modules():
        if isinstance(module, LoRALinear):
            nn.init.kaiming_uniform_(module.lora_a, a=math.sqrt(5))
            nn.init.zeros_(module.lora_b)


def lora_param_count(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


@torch.no_grad()
def merge_lora(model: nn.Module) -> None:
    """Fold each adapter into its base weight (W += scaling * B A) and make the layer a plain
    ``nn.Linear`` again: the model is then its family's own, for export."""
    for module in model.modules():
        if isinstance(module, LoRALinear):
            delta = (module.lora_b.float() @ module.lora_a.float()) * module.scaling
            module.weight.add_(delta.to(module.weight.dtype))
            del module.lora_a, module.lora_b
            module.__class__ = nn.Linear  # type: ignore[assignment]
            module.weight.requires_grad_(True)
            if module.bias is not None:
                module.bias.requires_grad_(True)


@torch.no_grad()
def drop_lora(model: nn.Module) -> None:
    """Remove the adapters without merging them: the model is its base again (what a PEFT
    adapter is loaded on)."""
    for module in model.modules():
        if isinstance(module, LoRALinear):
            del module.lora_a, module.lora_b
            module.__class__ = nn.Linear  # type: ignore[assignment]
