"""Inner learning-rate schedule: linear warmup, then cosine decay to a floor."""

from __future__ import annotations

import math

import torch


def warmup_cosine(step: int, total_steps: int, warmup_steps: int, min_ratio: float = 0.1) -> float:
    """Multiplier of the peak learning rate at `step` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def warmup_cosine_scheduler(
    optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int, min_ratio: float = 0.1
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR applying `warmup_cosine` to every parameter group."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: warmup_cosine(s, total_steps, warmup_steps, min_ratio)
    )
