"""The inner trainer refuses a step that would write NaN into the weights."""

from __future__ import annotations

import pytest
import torch
from groundswell.peer.config import DataSection, InnerSection
from groundswell.peer.data import Corpus
from groundswell.peer.worker import InnerTrainer
from groundswell.peer.workload import Workload
from torch import nn


class _InfGradient(nn.Module):
    """A model whose loss is 0 (finite) but whose gradient is inf: d sqrt(u)/du at u = 0."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))


def _inf_gradient_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.sqrt(model.weight - model.weight.detach()).sum()


@pytest.mark.parametrize("grad_clip", [1.0, 0.0])  # clip_grad_norm_'s norm, or one computed for the check
def test_a_finite_loss_with_a_non_finite_gradient_stops_before_the_optimizer_steps(grad_clip: float) -> None:
    tokens = torch.arange(200, dtype=torch.uint8)
    corpus = Corpus(name="t", train=tokens, heldout=tokens[:20], vocab_size=256, fingerprint="t")
    workload = Workload(model=_InfGradient(), loss_fn=_inf_gradient_loss, block_size=8, name="inf-grad")
    trainer = InnerTrainer(workload, corpus, DataSection(batch_size=2), InnerSection(lr=0.5, grad_clip=grad_clip),
                           total_steps=10, seed=0, shard_index=0, num_shards=1)
    words = r"inner step 0: gradient norm is (inf|nan): training diverged; try a lower inner.lr \(now 0.5\)"
    with pytest.raises(FloatingPointError, match=words):
        trainer.run(3)
    assert torch.equal(trainer.model.weight.detach(), torch.ones(4))  # was NaN after AdamW's step
    assert trainer.step == 0 and not trainer.optimizer.state
