"""Tests for the GPT model, its presets, and workload resolution (presets and module:callable)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from groundswell.peer.model import GPT, PRESETS, GPTConfig, gpt_loss, preset_config
from groundswell.peer.workload import Workload, WorkloadError, build_workload

# Expected sizes from the brief: tiny ~0.2M, small ~2M, base ~25M, 100m ~100M.
PARAM_RANGES = {
    "tiny": (0.15e6, 0.3e6),
    "small": (1.5e6, 2.5e6),
    "base": (20e6, 30e6),
    "100m": (90e6, 110e6),
}
EXPECTED_BLOCK_SIZES = {"tiny": 128, "small": 256, "base": 512, "100m": 512}


@pytest.fixture
def custom_module_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make tests/custom_model_example.py importable whatever pytest's import mode."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


def _count_params_on_meta(config: GPTConfig) -> int:
    # Building on the meta device allocates nothing, so even 100m is instant.
    with torch.device("meta"):
        return GPT(config).num_params()


@pytest.mark.parametrize("name", list(PARAM_RANGES))
def test_preset_param_counts(name: str) -> None:
    assert set(PRESETS) == set(PARAM_RANGES)
    config = PRESETS[name]
    low, high = PARAM_RANGES[name]
    assert low <= _count_params_on_meta(config) <= high
    assert config.vocab_size == 256 and config.block_size == EXPECTED_BLOCK_SIZES[name]


def test_num_params_counts_tied_embedding_once() -> None:
    model = GPT(PRESETS["tiny"])
    assert model.lm_head.weight is model.token_embedding.weight
    assert model.num_params() == sum(p.numel() for p in model.parameters())
    untied = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    assert untied == model.num_params() + 256 * 64


def test_forward_shapes_and_loss() -> None:
    config = GPTConfig(vocab_size=100, block_size=16, n_layer=2, n_head=2, n_embd=32)
    torch.manual_seed(0)
    model = GPT(config)
    idx = torch.randint(0, 100, (3, 16))
    logits, loss = model(idx)
    assert logits.shape == (3, 16, 100) and loss is None
    logits, loss = model(idx[:, :5], idx[:, 1:6])
    assert logits.shape == (3, 5, 100) and loss.dim() == 0
    assert abs(loss.item() - torch.log(torch.tensor(100.0)).item()) < 0.5  # near-uniform at init
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_attention_is_causal() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, block_size=12, n_layer=2, n_head=2, n_embd=16)).eval()
    idx = torch.randint(0, 50, (1, 12))
    changed = idx.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 50  # altering the future must not change the past
    assert torch.allclose(model(idx)[0][:, :8], model(changed)[0][:, :8], atol=1e-6)
    assert not torch.allclose(model(idx)[0][:, 8:], model(changed)[0][:, 8:])


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(n_embd=30, n_head=4)
    with pytest.raises(KeyError):
        preset_config("huge")
    assert preset_config("tiny", vocab_size=1000).vocab_size == 1000


def test_preset_workload_is_deterministic_from_seed() -> None:
    torch.manual_seed(123)
    rng_before = torch.get_rng_state()
    a = build_workload("tiny", vocab_size=256, seed=5)
    b = build_workload("tiny", vocab_size=256, seed=5)
    c = build_workload("tiny", vocab_size=256, seed=6)
    assert torch.equal(torch.get_rng_state(), rng_before)  # the caller's RNG is left alone
    assert isinstance(a, Workload) and a.name == "tiny" and a.block_size == 128 and a.loss_fn is gpt_loss
    for pa, pb, pc in zip(a.model.parameters(), b.model.parameters(), c.model.parameters()):
        assert torch.equal(pa, pb)
    assert not all(torch.equal(pa, pc) for pa, pc in zip(a.model.parameters(), c.model.parameters()))
    assert build_workload("small", vocab_size=512, seed=0).model.config.vocab_size == 512


def test_building_a_workload_leaves_the_cuda_generators_alone(monkeypatch) -> None:
    # torch.manual_seed also seeds every CUDA device (queued until CUDA starts, where it has not),
    # which fork_rng(devices=[]) does not put back: a scorer or scratch model built on a CUDA peer
    # reset its dropout stream. The parameters are still those of the seed.
    seeded: list[int] = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", seeded.append)
    a = build_workload("tiny", vocab_size=256, seed=5)
    assert seeded == []
    torch.manual_seed(5)  # what the seed alone gives on the CPU
    from groundswell.peer.model import GPT

    b = GPT(preset_config("tiny", vocab_size=256))
    assert all(torch.equal(pa, pb) for pa, pb in zip(a.model.parameters(), b.parameters()))


def test_adamw_steps_reduce_loss_on_a_repeated_batch() -> None:
    workload = build_workload("tiny", vocab_size=256, seed=0)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (4, 33), generator=generator)
    x, y = tokens[:, :-1], tokens[:, 1:]
    optimizer = torch.optim.AdamW(workload.model.parameters(), lr=3e-3)
    losses = []
    for _ in range(15):
        loss = workload.loss_fn(workload.model, x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0, losses


@pytest.mark.usefixtures("custom_module_on_path")
def test_custom_module_callable_workload() -> None:
    a = build_workload("custom_model_example:make_model", vocab_size=300, seed=1)
    b = build_workload("custom_model_example:make_model", vocab_size=300, seed=1)
    assert a.name == "custom_model_example:make_model" and a.block_size == 64
    assert all(torch.equal(pa, pb) for pa, pb in zip(a.model.parameters(), b.model.parameters()))
    x = torch.randint(0, 300, (2, a.block_size))
    loss = a.loss_fn(a.model, x, x)
    assert loss.dim() == 0 and loss.requires_grad
    assert a.model.embedding.num_embeddings == 300  # vocab_size was passed through

    explicit = build_workload("custom_model_example:make_model_with_block_size", vocab_size=256, seed=0)
    assert explicit.block_size == 32


@pytest.mark.usefixtures("custom_module_on_path")
@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("huge", "unknown workload"),
        ("", "non-empty"),
        ("no_such_module_xyz:make", "cannot import"),
        ("custom_model_example:missing", "no attribute"),
        ("custom_model_example:NOT_CALLABLE", "not callable"),
        ("custom_model_example:returns_wrong_type", "expected"),
        ("custom_model_example:returns_non_module", "torch.nn.Module"),
        ("custom_model_example:raises", "boom"),
        ("custom_model_example:with_batch_norm", "running statistics .norm.*track_running_stats=False"),
        ("custom_model_example:in_bfloat16", "bfloat16 parameters: keep them float32"),
        ("custom_model_example:with_spectral_norm", "buffers that every training step changes .*out.parametrizations"),
        ("custom_model_example:", "module:callable"),
    ],
)
def test_bad_specs_raise_workload_error(spec: str, message: str) -> None:
    with pytest.raises(WorkloadError, match=message):
        build_workload(spec, vocab_size=256, seed=0)
    assert issubclass(WorkloadError, ValueError)


@pytest.mark.usefixtures("custom_module_on_path")
def test_a_cache_filled_once_and_a_transposed_weight_are_taken() -> None:
    # (found by a review, 2026-12-07: a non-contiguous parameter passed the checks and then failed
    # the outer optimizer's flattening with a cryptic view error)
    from groundswell.optim import DiLoCo, DiLoCoConfig

    build_workload("custom_model_example:with_a_growing_cache", vocab_size=64, seed=0)  # (its copy back failed)
    build_workload("custom_model_example:with_a_nan_sentinel", vocab_size=64, seed=0)  # (NaN != NaN was a change)
    cached = build_workload("custom_model_example:with_a_cache", vocab_size=64, seed=0)
    assert float(cached.model.scale) == 1.0  # filled, as its forward marked it (put back to 0, it trained on 0)
    transposed = build_workload("custom_model_example:with_a_transposed_weight", vocab_size=64, seed=0)
    assert all(p.is_contiguous() for p in transposed.model.parameters())
    from groundswell.compression import make_codec

    outer = DiLoCo(list(transposed.model.parameters()), make_codec("fp32"), DiLoCoConfig())
    assert outer.global_params.numel() == sum(p.numel() for p in transposed.model.parameters())


@pytest.mark.usefixtures("custom_module_on_path")
def test_a_model_whose_buffers_cannot_be_checked_is_taken_with_a_warning(caplog) -> None:
    import logging

    with caplog.at_level(logging.WARNING):
        build_workload("custom_model_example:with_spectral_norm_and_a_gradient_loss", vocab_size=64, seed=0)
    assert any("could not check whether training changes" in r.getMessage() for r in caplog.records)
