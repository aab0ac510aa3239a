"""Model families behind one `build_model`: ``gpt`` (trainer.model), ``llama``
(trainer.llama), ``moe`` (trainer.moe: the llama with experts) and ``hf`` (trainer.hfmodel:
any transformers causal LM from a local folder), chosen by the spec's ``train.model.family``.

Every family's model has the same shape to the trainer (`Decoder`): ``blocks`` (what FSDP
shards and activation checkpointing wraps), ``init_weights()`` (drawn from the current RNG,
after sharding), ``forward(idx, targets)``, ``num_params()`` and ``flops_per_token()``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch
from pydantic import TypeAdapter
from torch import nn

from trainer.config import AnyModelConfig, HFModelConfig, LlamaConfig, MoeConfig

__all__ = ["Decoder", "build_model", "model_config", "vocab_size"]


class Decoder(Protocol):
    cfg: Any
    blocks: nn.ModuleList

    def init_weights(self) -> None: ...
    def num_params(self, exclude_embedding: bool = False) -> int: ...
    def flops_per_token(self) -> int: ...
    def __call__(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> Any: ...


_CONFIG: TypeAdapter[AnyModelConfig] = TypeAdapter(AnyModelConfig)


def model_config(raw: dict[str, Any]) -> AnyModelConfig:
    """A model config from its dict (a checkpoint's meta; no ``family`` means gpt)."""
    return _CONFIG.validate_python(raw)


def vocab_size(cfg: AnyModelConfig) -> int:
    """The model's vocabulary (an ``hf`` model's from its config.json, path resolved)."""
    if isinstance(cfg, HFModelConfig):
        from trainer.hfmodel import hf_vocab_size

        return hf_vocab_size(Path(cfg.path))
    return cfg.vocab_size


def build_model(cfg: AnyModelConfig) -> nn.Module:
    """The model of ``cfg``'s family, its weights not yet drawn (call ``init_weights``)."""
    if isinstance(cfg, MoeConfig):
        from trainer.moe import MoE

        return MoE(cfg)
    if isinstance(cfg, LlamaConfig):
        from trainer.llama import Llama

        return Llama(cfg)
    if isinstance(cfg, HFModelConfig):
        from trainer.hfmodel import HFCausalLM

        return HFCausalLM(cfg)
    from trainer.model import GPT

    return GPT(cfg)
