"""The ``hf`` family: any causal language model ``transformers`` builds from a local folder,
behind the trainer's model interface (``trainer.models.Decoder``).

``from_pretrained`` semantics: a folder with weights (``model.safetensors``, sharded
safetensors with their index, or ``pytorch_model.bin``) starts from them; a folder with
only ``config.json`` starts from fresh weights drawn from the current torch RNG (the trainer
seeds it, so every rank and every strategy draws the same).

The repeated decoder layers, which FSDP2 shards one by one and activation checkpointing
wraps, are found from the model itself: the ``nn.ModuleList`` whose elements are of a class
named in the model's ``_no_split_modules`` (what transformers itself never splits across
devices), so a new architecture needs no table here.

``transformers`` is imported here only: the ``hf`` extra (``pip install 'trainq[hf]'``);
without it a spec of this family fails as a spec_error naming the extra.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainer.config import ConfigError, HFModelConfig

__all__ = ["HFCausalLM", "hf_vocab_size"]

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def _config_json(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"model.path {folder.name!r} has no config.json") from None
    except (OSError, ValueError):  # not the parser's words: they would quote the file
        raise ConfigError(f"model.path {folder.name!r}: config.json is unreadable") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"model.path {folder.name!r}: config.json is not an object")
    return raw


def hf_vocab_size(folder: Path) -> int:
    """The model's vocabulary, from its config.json (no torch or transformers needed)."""
    vocab = _config_json(folder).get("vocab_size")
    if not isinstance(vocab, int) or vocab < 1:
        raise ConfigError(f"model.path {folder.name!r}: config.json has no vocab_size")
    return vocab


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            "model.family hf needs transformers on the worker: pip install 'trainq[hf]'"
        ) from None
    return transformers


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    names = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if (
            isinstance(module, nn.ModuleList)
            and len(module) > 0
            and all(type(m).__name__ in names for m in module)
        ):
            return module
    raise ConfigError(
        f"model.path: cannot find the decoder layers of {type(model).__name__} "
        f"(no ModuleList of {sorted(names) or 'its _no_split_modules'})"
    )


class HFCausalLM(nn.Module):
    """A transformers causal LM with the trainer's interface: ``blocks``, ``init_weights``,
    ``forward(idx, targets)``, ``num_params``, ``flops_per_token``."""

    def __init__(self, cfg: HFModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.folder = Path(cfg.path)
        transformers = _transformers()
        self.config = transformers.AutoConfig.from_pretrained(self.folder, local_files_only=True)
        self.inner = transformers.AutoModelForCausalLM.from_config(self.config)
        # Not a registered child: the layers are already inside ``inner``, and a second
        # registration would name every parameter twice in the state dict.
        object.__setattr__(self, "_layers", _decoder_layers(self.inner))

    @property
    def blocks(self) -> nn.ModuleList:
        layers: nn.ModuleList = object.__getattribute__(self, "_layers")
        return layers

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    def has_weights(self) -> bool:
        return any((self.folder / name).is_file() for name in WEIGHT_FILES)

    @torch.no_grad()
    def init_weights(self) -> None:
        """The folder's weights when it has them, else fresh ones from the torch RNG."""
        if self.has_weights():
            pretrained = _transformers().AutoModelForCausalLM.from_pretrained(
                self.folder, local_files_only=True, torch_dtype=torch.float32
            )
            self.inner.load_state_dict(pretrained.state_dict())
        else:
            self.inner.apply(self.inner._init_weights)
            self.inner.tie_weights()

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        doc: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits, or the mean cross-entropy when targets are given. ``doc``: packed rows'
        document ids (trainer.data), passed as ``position_ids`` that restart at each
        document: transformers' masking (``masking_utils.find_packed_sequence_indices``)
        then keeps attention inside each one (sdpa and eager; checked by the tests)."""
        if doc is None:
            logits = self.inner(input_ids=idx, use_cache=False).logits
        else:
            from trainer.model import doc_positions

            logits = self.inner(
                input_ids=idx, position_ids=doc_positions(doc), use_cache=False
            ).logits
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))

    def num_params(self, exclude_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        if exclude_embedding:
            n -= self.inner.get_input_embeddings().weight.numel()
        return n

    def flops_per_token(self) -> int:
        """6N + 12*L*H*Q*T (H*Q = the hidden size), N without the input embedding, as the
        native families count it."""
        c = self.config
        layers = int(getattr(c, "num_hidden_layers", len(self.blocks)))
        width = int(getattr(c, "hidden_size", 0))
        n = self.num_params(exclude_embedding=True)
        if getattr(c, "tie_word_embeddings", False):
            n += self.inner.get_input_embeddings().weight.numel()
        return 6 * n + 12 * layers * width * self.cfg.seq_len
