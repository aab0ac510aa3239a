"""The GPT decoder the trainer trains: pre-LN blocks, causal SDPA attention, GELU MLP, tied head.

Sized from `trainer.config.ModelConfig`. This module knows nothing of processes or devices
(no ``torch.distributed``): `trainer.parallelize` wraps it for DDP or FSDP2. It is nanoGPT's
model with torchtitan's split between building a module and initializing its weights, so the
caller decides when (and under which seed) weights are drawn.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from trainer.config import ModelConfig

__all__ = ["GPT", "Block", "cached_attention", "doc_mask", "doc_positions"]

INIT_STD = 0.02


def cached_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int,
    gqa: bool = False,
    pad: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of queries at columns ``start ..`` (``q`` ``[B, H, T, D]``) over
    keys and values at columns ``0 .. start+T`` (the cache and the new tokens). ``pad``
    ``[B]``: each row's left padding, columns its queries never see (a padding query sees
    itself only, so nothing in its row turns to nan)."""
    T = q.shape[2]
    if pad is not None:
        cols = torch.arange(k.shape[2], device=q.device)
        rows = torch.arange(start, start + T, device=q.device)
        causal = cols[None, :] <= rows[:, None]
        own = (cols[None, None, :] >= pad[:, None, None]) | (cols[None, :] == rows[:, None])
        mask = (causal[None] & own)[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    if T == 1:  # one new token sees everything before it: no mask
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    if start == 0:  # the prompt: the training path's causal attention
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    rows = torch.arange(start, start + T, device=q.device)[:, None]
    mask = torch.arange(k.shape[2], device=q.device)[None, :] <= rows
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def doc_positions(doc: torch.Tensor) -> torch.Tensor:
    """Each token's position within its document (``doc`` ``[B, T]``: packed rows'
    document ids, trainer.data), restarting at 0 where the id changes."""
    T = doc.shape[1]
    cols = torch.arange(T, device=doc.device).expand_as(doc)
    first = torch.ones_like(doc, dtype=torch.bool)
    first[:, 1:] = doc[:, 1:] != doc[:, :-1]
    starts = torch.where(first, cols, torch.zeros_like(cols)).cummax(dim=1).values
    return cols - starts


def doc_mask(doc: torch.Tensor) -> torch.Tensor:
    """The block-diagonal causal mask ``[B, 1, T, T]`` (True: may attend) of packed rows:
    a token sees the tokens before it in its own document only."""
    T = doc.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc.device).tril()
    return (causal[None] & (doc[:, :, None] == doc[:, None, :]))[:, None]


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # [B, T, C] -> [B, heads, T, head_dim]
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # packed rows: causal within each document (doc_mask)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))

    def forward_cached(self, x: torch.Tensor, cache: Any, layer: int) -> torch.Tensor:
        """``forward`` for tokens at positions ``cache.pos ...``: their keys and values join
        the cache, and they attend to every cached position (generation; trainer.generate)."""
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        k, v = cache.update(layer, k, v)
        y = cached_attention(q, k, v, cache.pos, pad=getattr(cache, "pad", None))
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """One pre-LN transformer block; the unit FSDP shards."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), mask)
        return x + self.mlp(self.ln2(x))

    def forward_cached(self, x: torch.Tensor, cache: Any, layer: int) -> torch.Tensor:
        x = x + self.attn.forward_cached(self.ln1(x), cache, layer)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one matrix embeds and predicts

    @torch.no_grad()
    def init_weights(self) -> None:
        """Draw every weight from the current torch RNG (the caller seeds it).

        Normal(0, 0.02) for linears and embeddings; the residual projections get
        0.02 / sqrt(2 * n_layer) so the residual stream's variance does not grow with depth
        (GPT-2); LayerNorms start as identity, biases at zero.
        """
        residual_std = INIT_STD / math.sqrt(2 * self.cfg.n_layer)
        for name, module in self.named_modules():
            if module is self.lm_head:
                continue  # tied to wte, drawn once there
            if isinstance(module, nn.Linear):
                std = residual_std if name.endswith(".proj") else INIT_STD
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        doc: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[B, T, vocab]``, or the mean cross-entropy (fp32) when targets are given.
        ``doc`` ``[B, T]``: packed rows' document ids (trainer.data); positions restart at
        each document and attention stays inside it."""
        T = idx.shape[1]
        assert self.cfg.seq_len >= T, f"sequence length {T} > model seq_len {self.cfg.seq_len}"
        if doc is None:
            pos, mask = torch.arange(T, device=idx.device), None
        else:
            pos, mask = doc_positions(doc), doc_mask(doc)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x) if mask is None else block(x, mask)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        # The loss in fp32 even under bf16/fp16: log-softmax over a big vocab loses precision.
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))

    @torch.no_grad()
    def forward_cached(self, idx: torch.Tensor, cache: Any) -> torch.Tensor:
        """Logits ``[B, T, vocab]`` of tokens ``idx`` at positions ``cache.pos ..``, their
        keys and values added to ``cache`` (a ``trainer.generate.KVCache``): incremental
        decoding. The training path (``forward``) is untouched."""
        start, T = cache.pos, idx.shape[1]
        assert start + T <= self.cfg.seq_len, f"position {start + T} > seq_len {self.cfg.seq_len}"
        pos = torch.arange(start, start + T, device=idx.device)
        pad = getattr(cache, "pad", None)
        if pad is not None:  # left-padded rows: each its own positions
            pos = (pos[None, :] - pad[:, None]).clamp(min=0)
        x = self.wte(idx) + self.wpe(pos)
        for layer, block in enumerate(self.blocks):
            x = cast(Block, block).forward_cached(x, cache, layer)
        cache.advance(T)
        return self.lm_head(self.ln_f(x))

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Distinct parameters (the tied head counted once); optionally without the embeddings."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embedding:
            n -= self.wte.weight.numel() + self.wpe.weight.numel()
        return n

    def flops_per_token(self) -> int:
        """Training FLOPs per token: 6N for the matmuls plus 12*L*H*Q*T for attention.

        The PaLM appendix B estimate that nanoGPT's ``estimate_mfu`` uses (N without the
        position embedding, which does no matmul).
        """
        c = self.cfg
        n = self.num_params() - self.wpe.weight.numel()
        return 6 * n + 12 * c.n_layer * c.n_head * (c.d_model // c.n_head) * c.seq_len
