"""A small decoder-only GPT (byte-level by default), in the spirit of nanoGPT's model.py.

Pre-LayerNorm transformer blocks, causal self-attention through
``F.scaled_dot_product_attention``, learned position embeddings, and an LM head tied
to the token embedding. Initialisation follows GPT-2 and draws only from torch's
global RNG, so seeding torch before construction gives bit-identical parameters on
every worker.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT model."""

    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    # Biases in Linear/LayerNorm add parameters and communication for no measurable
    # gain at these scales (as in nanoGPT's own recommendation), so they default off.
    bias: bool = False

    def __post_init__(self) -> None:
        for field_name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, field_name) < 1:
                raise ValueError(f"GPTConfig.{field_name} must be >= 1, got {getattr(self, field_name)}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")


# Named sizes; all byte-level (vocab 256) until a corpus says otherwise.
# Approximate parameter counts (bias=False): tiny 0.22M, small 2.0M, base 25.6M, 100m 99.7M.
PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=64),
    "small": GPTConfig(vocab_size=256, block_size=256, n_layer=10, n_head=4, n_embd=128),
    "base": GPTConfig(vocab_size=256, block_size=512, n_layer=8, n_head=8, n_embd=512),
    "100m": GPTConfig(vocab_size=256, block_size=512, n_layer=14, n_head=12, n_embd=768),
}


def preset_config(name: str, **overrides: object) -> GPTConfig:
    """Return the named preset config, with optional field overrides (e.g. vocab_size)."""
    if name not in PRESETS:
        raise KeyError(f"unknown GPT preset {name!r}; choose one of {sorted(PRESETS)}")
    return replace(PRESETS[name], **overrides)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position sees only itself and the past."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.proj.is_residual_projection = True  # scaled-down init, see GPT._init_weights
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        """Causal self-attention over (B, T, C) activations, same shape out."""
        batch, seq, channels = x.shape
        q, k, v = self.qkv(x).split(channels, dim=2)
        # (B, T, C) -> (B, heads, T, head_dim)
        head_dim = channels // self.n_head
        q, k, v = (t.view(batch, seq, self.n_head, head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(batch, seq, channels)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward network with the usual 4x expansion."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.proj.is_residual_projection = True
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        """The 4x-wide GELU feed-forward, (B, T, C) to (B, T, C)."""
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_mlp = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        """Pre-norm residual block: attention, then the MLP."""
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class GPT(nn.Module):
    """Decoder-only transformer language model with tied input/output embeddings."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.block_size = config.block_size
        self.token_embedding = nn.Embedding(config.vocab_size, config.n_embd)
        self.position_embedding = nn.Embedding(config.block_size, config.n_embd)
        self.embed_dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_final = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying: one matrix both embeds tokens and scores them. parameters()
        # yields it once, so optimizers and gradient exchange see a single tensor.
        self.lm_head.weight = self.token_embedding.weight
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        # GPT-2 init: N(0, 0.02) everywhere; projections that write into the residual
        # stream are scaled by 1/sqrt(2 * n_layer) so its variance stays O(1) with depth.
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "is_residual_projection", False):
                std /= math.sqrt(2 * self.config.n_layer)
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        """Number of distinct trainable parameters (the tied embedding counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Return logits (B, T, vocab) and, if targets (B, T) are given, the mean cross-entropy."""
        _, seq = idx.shape
        if seq > self.config.block_size:
            raise ValueError(f"sequence length {seq} exceeds block_size {self.config.block_size}")
        positions = torch.arange(seq, device=idx.device)
        x = self.embed_dropout(self.token_embedding(idx) + self.position_embedding(positions))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_final(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def gpt_loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """Workload loss function for GPT: mean next-token cross-entropy."""
    _, loss = model(x, y)
    return loss


if __name__ == "__main__":
    # Print each preset's size: `python -m groundswell.peer.model`.
    for preset_name, preset in PRESETS.items():
        n = GPT(preset).num_params()
        print(f"{preset_name:>6}: {n:>12,} params  ({n / 1e6:.2f}M)  {preset}")
