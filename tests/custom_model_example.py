"""Example of a user-supplied workload, loaded as ``custom_model_example:make_model``.

A tiny MLP language model: each position predicts the next token from an embedding of
its own token and of the previous one (a learned bigram/trigram-ish model). It is here
for tests and as a template for ``--workload module:callable``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class TinyMLPLanguageModel(nn.Module):
    """Predicts token t+1 from tokens t and t-1 through a one-hidden-layer MLP."""

    def __init__(self, vocab_size: int, block_size: int = 64, embd: int = 32, hidden: int = 128) -> None:
        super().__init__()
        self.block_size = block_size
        self.embedding = nn.Embedding(vocab_size, embd)
        self.hidden = nn.Linear(2 * embd, hidden)
        self.out = nn.Linear(hidden, vocab_size)

    def forward(self, idx: Tensor) -> Tensor:
        current = self.embedding(idx)
        previous = F.pad(current, (0, 0, 1, 0))[:, :-1]  # shift right; zeros at t = 0
        return self.out(F.gelu(self.hidden(torch.cat([current, previous], dim=-1))))


def next_token_loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """Mean cross-entropy of the model's next-token logits."""
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def make_model(vocab_size: int) -> tuple[nn.Module, object]:
    """Workload factory: returns (model, loss_fn); block_size is read from the model."""
    return TinyMLPLanguageModel(vocab_size), next_token_loss


def make_model_with_block_size(vocab_size: int) -> tuple[nn.Module, object, int]:
    """Workload factory returning (model, loss_fn, block_size) explicitly."""
    return TinyMLPLanguageModel(vocab_size, block_size=32), next_token_loss, 32


# Deliberately broken factories, for the error-path tests.
def returns_wrong_type(vocab_size: int) -> str:
    return "not a model"


def returns_non_module(vocab_size: int) -> tuple[object, object]:
    return object(), next_token_loss


def raises(vocab_size: int) -> None:
    raise RuntimeError("boom")


def with_batch_norm(vocab_size: int) -> tuple[nn.Module, object]:
    # its running statistics are buffers peers never exchange
    model = TinyMLPLanguageModel(vocab_size)
    model.norm = nn.BatchNorm1d(8)
    return model, next_token_loss


def in_bfloat16(vocab_size: int) -> tuple[nn.Module, object]:
    # the outer optimizers' fp32 global parameters would round into it every round
    return TinyMLPLanguageModel(vocab_size).to(torch.bfloat16), next_token_loss


NOT_CALLABLE = 42
