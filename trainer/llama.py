"""A Llama-style decoder: RMSNorm, rotary position embeddings, SwiGLU MLP, grouped-query
attention, no biases, optionally tied embeddings.

Sized from `trainer.config.LlamaConfig`. Like `trainer.model` (the GPT) it knows nothing of
processes or devices (no ``torch.distributed``): built on meta, sharded by
`trainer.parallelize`, then its weights drawn by `init_weights` (torchtitan's order).

Rotary embeddings use the "rotate half" layout (the first half of each head's dimensions
pairs with the second half), which is Hugging Face's ``LlamaForCausalLM`` layout: weights
move between the two with no permutation (``trainer.hf``). The cos/sin tables are computed
per sequence length and device, not kept as buffers, so a model materialized from meta or
loaded from a state dict has nothing left uninitialized.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from trainer.config import LlamaConfig
from trainer.model import cached_attention, doc_mask, doc_positions

__all__ = ["Llama", "LlamaBlock", "rope_tables"]

INIT_STD = 0.02


def rope_tables(
    head_dim: int, seq_len: int, theta: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each ``[seq_len, head_dim]`` (the half-table repeated), in fp32."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device).float(), inv)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[B, heads, T, head_dim]`` by position (computed in fp32)."""
    xf = x.float()
    return (xf * cos + _rotate_half(xf) * sin).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head = cfg.n_head, cfg.kv_heads
        self.head_dim = cfg.d_model // cfg.n_head
        self.wq = nn.Linear(cfg.d_model, self.n_head * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, self.n_kv_head * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, self.n_kv_head * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_head * self.head_dim, cfg.d_model, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # Each key/value head serves a group of queries: SDPA's own GQA, no repeated copies.
        gqa = self.n_kv_head != self.n_head
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:  # packed rows: causal within each document (trainer.model.doc_mask)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))

    def forward_cached(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Any, layer: int
    ) -> torch.Tensor:
        """``forward`` for tokens at positions ``cache.pos ..`` (``cos``/``sin`` of those
        positions), attending to the cached keys and values too (trainer.generate)."""
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v = cache.update(layer, k, v)
        gqa = self.n_kv_head != self.n_head
        y = cached_attention(q, k, v, cache.pos, gqa=gqa, pad=getattr(cache, "pad", None))
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.hidden, bias=False)
        self.w2 = nn.Linear(cfg.hidden, cfg.d_model, bias=False)
        self.w3 = nn.Linear(cfg.d_model, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    """One pre-norm block; the unit FSDP shards and activation checkpointing wraps."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return x + self.feed_forward(self.ffn_norm(x))

    def forward_cached(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Any, layer: int
    ) -> torch.Tensor:
        x = x + self.attention.forward_cached(self.attention_norm(x), cos, sin, cache, layer)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    # The block a family builds on this decoder (trainer.moe swaps the feed-forward in its own)
    block_class: type[LlamaBlock] = LlamaBlock

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(self.block_class(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """Draw every weight from the current torch RNG (the caller seeds it): Normal(0,
        0.02), the residual projections (wo, w2) scaled by 1/sqrt(2 * n_layer); norms at 1."""
        residual_std = INIT_STD / math.sqrt(2 * self.cfg.n_layer)
        for name, module in self.named_modules():
            if module is self.output and self.cfg.tie_embeddings:
                continue  # drawn once, as the embedding
            if isinstance(module, nn.Linear):
                std = residual_std if name.endswith((".wo", ".w2")) else INIT_STD
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
            elif isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)

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
        cos, sin = rope_tables(
            self.cfg.d_model // self.cfg.n_head, T, self.cfg.rope_theta, idx.device
        )
        mask = None
        if doc is not None:  # each token rotated by its position in its document
            pos = doc_positions(doc)
            cos, sin, mask = cos[pos][:, None], sin[pos][:, None], doc_mask(doc)
        x = self.tok_embeddings(idx)
        for block in self.blocks:
            x = block(x, cos, sin) if mask is None else block(x, cos, sin, mask)
        logits = self.output(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))

    @torch.no_grad()
    def forward_cached(self, idx: torch.Tensor, cache: Any) -> torch.Tensor:
        """Logits ``[B, T, vocab]`` of tokens ``idx`` at positions ``cache.pos ..``, their
        keys and values added to ``cache`` (a ``trainer.generate.KVCache``): incremental
        decoding. The rotary tables are computed once per cache, for its whole length."""
        start, T = cache.pos, idx.shape[1]
        assert start + T <= cache.max_len, f"position {start + T} > cache length {cache.max_len}"
        if cache.rope is None:  # by position: a table as long as the context
            head_dim = self.cfg.d_model // self.cfg.n_head
            length = max(cache.max_len, self.cfg.seq_len)
            cache.rope = rope_tables(head_dim, length, self.cfg.rope_theta, idx.device)
        pad = getattr(cache, "pad", None)
        if pad is None:
            cos, sin = cache.rope[0][start : start + T], cache.rope[1][start : start + T]
        else:  # left-padded rows: each its own positions, [B, 1, T, head_dim]
            pos = torch.arange(start, start + T, device=idx.device)
            pos = (pos[None, :] - pad[:, None]).clamp(min=0)
            cos, sin = cache.rope[0][pos][:, None], cache.rope[1][pos][:, None]
        x = self.tok_embeddings(idx)
        for layer, block in enumerate(self.blocks):
            x = cast(LlamaBlock, block).forward_cached(x, cos, sin, cache, layer)
        cache.advance(T)
        return self.output(self.norm(x))

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Distinct parameters (a tied output counted once); optionally without the embedding."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embedding:
            n -= self.tok_embeddings.weight.numel()
        return n

    def flops_per_token(self) -> int:
        """Training FLOPs per token, 6N + 12*L*H*Q*T (as the GPT's); N without the input
        embedding, a lookup (a tied output's matmul still counts)."""
        c = self.cfg
        n = self.num_params(exclude_embedding=True)
        if c.tie_embeddings:
            n += self.tok_embeddings.weight.numel()
        return 6 * n + 12 * c.n_layer * c.n_head * (c.d_model // c.n_head) * c.seq_len
