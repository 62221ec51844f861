"""A small causal character-level transformer (pre-norm GPT blocks).

Parameters cover the shapes an optimizer has to handle: 2-D matrices (embeddings, attention
and MLP weights, an untied head), a 2-D learned position table, and 1-D LayerNorm weights and
biases. Initialisation is deterministic from a seed and leaves torch's global RNG alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of a :class:`CharTransformer`."""

    vocab_size: int
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    max_seq_len: int = 64
    mlp_ratio: int = 4
    tied_head: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")

    @classmethod
    def preset(cls, name: str, vocab_size: int, **overrides: int | bool) -> ModelConfig:
        """A named size from :data:`MODEL_PRESETS`, with optional field overrides."""
        if name not in MODEL_PRESETS:
            raise ValueError(f"unknown model preset {name!r}; known: {', '.join(MODEL_PRESETS)}")
        fields: dict[str, Any] = {**MODEL_PRESETS[name], **overrides}
        return cls(vocab_size=vocab_size, **fields)


MODEL_PRESETS: dict[str, dict[str, int]] = {
    "toy": {"d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 32},
    "tiny": {"d_model": 128, "n_layers": 2, "n_heads": 4, "max_seq_len": 64},
    "small": {"d_model": 192, "n_layers": 4, "n_heads": 6, "max_seq_len": 128},
    "base": {"d_model": 384, "n_layers": 6, "n_heads": 6, "max_seq_len": 256},
}


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a GELU MLP, both residual."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, cfg.mlp_ratio * d)
        self.out = nn.Linear(cfg.mlp_ratio * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class CharTransformer(nn.Module):
    """Token + position embeddings, ``n_layers`` blocks, final LayerNorm, linear head."""

    def __init__(self, cfg: ModelConfig, seed: int = 0) -> None:
        with torch.random.fork_rng(devices=[]):  # module constructors draw from the global RNG
            super().__init__()
            self.cfg = cfg
            self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.pos_emb = nn.Parameter(torch.zeros(cfg.max_seq_len, cfg.d_model))
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
            self.ln_f = nn.LayerNorm(cfg.d_model)
            self.head = None if cfg.tied_head else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.reset_parameters(seed)

    def reset_parameters(self, seed: int) -> None:
        """GPT-2 style init from ``seed``: N(0, 0.02), residual projections scaled by
        ``1/sqrt(2 n_layers)``, LayerNorm weights 1, biases 0."""
        gen = torch.Generator().manual_seed(seed)
        resid_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("bias"):
                    p.zero_()
                elif ".ln" in name or name.startswith("ln_"):
                    p.fill_(1.0)
                else:
                    std = resid_std if name.endswith(("proj.weight", "out.weight")) else 0.02
                    p.copy_(torch.randn(p.shape, generator=gen) * std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """``(batch, t)`` int64 ids -> ``(batch, t, vocab)`` logits; position ``i`` sees ``<= i``."""
        t = idx.shape[1]
        if t > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {t} > max_seq_len {self.cfg.max_seq_len}")
        x = self.tok_emb(idx) + self.pos_emb[:t]
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        return self.head(x) if self.head is not None else x @ self.tok_emb.weight.t()

    def num_params(self) -> int:
        """Number of scalar parameters."""
        return sum(p.numel() for p in self.parameters())
