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


def with_spectral_norm(vocab_size: int) -> tuple[nn.Module, object]:
    # its power-iteration vectors are buffers every training step changes, and peers never exchange
    model = TinyMLPLanguageModel(vocab_size)
    model.out = nn.utils.parametrizations.spectral_norm(model.out)
    return model, next_token_loss


class _CachedScale(TinyMLPLanguageModel):
    """A buffer filled on first use, then never changed: the same on every peer, so allowed."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__(vocab_size)
        self.register_buffer("scale", torch.zeros(1))

    def forward(self, idx: Tensor) -> Tensor:
        if not bool(self.scale.any()):
            self.scale.fill_(1.0)
        return super().forward(idx) * self.scale


def with_a_cache(vocab_size: int) -> tuple[nn.Module, object]:
    return _CachedScale(vocab_size), next_token_loss


class _GrowingCache(TinyMLPLanguageModel):
    """A cache registered empty and made full-size on first use (rotary tables, say)."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__(vocab_size)
        self.register_buffer("table", torch.zeros(0, 4))

    def forward(self, idx: Tensor) -> Tensor:
        if self.table.numel() == 0:
            self.table = torch.ones(self.block_size, 4)
        return super().forward(idx)


class _NanSentinel(TinyMLPLanguageModel):
    """A buffer that holds NaN ("not computed yet") and is never touched in training."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__(vocab_size)
        self.register_buffer("last_eval_loss", torch.tensor(float("nan")))


def with_a_nan_sentinel(vocab_size: int) -> tuple[nn.Module, object]:
    return _NanSentinel(vocab_size), next_token_loss


def with_a_growing_cache(vocab_size: int) -> tuple[nn.Module, object]:
    return _GrowingCache(vocab_size), next_token_loss


def _loss_with_an_input_gradient(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """A loss that needs autograd even when only evaluated (an input-gradient penalty)."""
    emb = model.embedding(x).requires_grad_(True) if not torch.is_grad_enabled() else model.embedding(x)
    logits = model.out(F.gelu(model.hidden(torch.cat([emb, emb], dim=-1))))
    ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
    (grad,) = torch.autograd.grad(ce, emb, create_graph=True)
    return ce + grad.pow(2).mean()


def with_spectral_norm_and_a_gradient_loss(vocab_size: int) -> tuple[nn.Module, object]:
    # not checkable (its loss needs gradients the probe turns off): taken, with a warning
    model, _ = with_spectral_norm(vocab_size)
    return model, _loss_with_an_input_gradient


def with_a_transposed_weight(vocab_size: int) -> tuple[nn.Module, object]:
    # a parameter stored as a transposed view (not contiguous), as channels_last conv weights are
    model = TinyMLPLanguageModel(vocab_size)
    model.hidden.weight = nn.Parameter(model.hidden.weight.detach().t().contiguous().t())
    assert not model.hidden.weight.is_contiguous()
    return model, next_token_loss


_unseeded = __import__("numpy").random.default_rng()  # (not torch's generator: train-local cannot seed it)


def seeded_elsewhere(vocab_size: int) -> tuple[nn.Module, object]:
    # initialised from a generator nobody seeds: each call builds other weights
    model = TinyMLPLanguageModel(vocab_size)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.from_numpy(_unseeded.normal(0, 0.02, tuple(p.shape)).astype("float32")))
    return model, next_token_loss


LAYER_ORDER = ("hidden", "out")  # a test sets it: as a model registering its layers from a set would vary


class _Reordered(TinyMLPLanguageModel):
    def __init__(self, vocab_size: int) -> None:
        nn.Module.__init__(self)
        self.block_size = 64
        self.embedding = nn.Embedding(vocab_size, 32)
        layers = {"hidden": nn.Linear(64, 128), "out": nn.Linear(128, vocab_size)}
        for name in LAYER_ORDER:
            self.add_module(name, layers[name])


def registered_in_varying_order(vocab_size: int) -> tuple[nn.Module, object]:
    # the same names, shapes and count in every process, flattened in LAYER_ORDER's order
    return _Reordered(vocab_size), next_token_loss


NOT_CALLABLE = 42
