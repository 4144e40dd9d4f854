"""What a peer trains: a model, its loss function and its context length.

A workload spec is either a GPT preset name from ``groundswell.peer.model.PRESETS``
(``"tiny"``, ``"small"``, ...) or ``"module:callable"`` naming user code. The callable
is invoked as ``callable(vocab_size=...)`` and returns ``(model, loss_fn)``,
``(model, loss_fn, block_size)`` or an object with ``model``, ``loss_fn`` and
``block_size`` attributes (such as a ``Workload``).

Every worker of a run must start from identical parameters, so construction happens
with the CPU generator seeded by ``seed`` inside a forked RNG scope: same seed, same
weights, and the caller's RNG state (CPU and CUDA) is left untouched.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from groundswell.peer.model import GPT, PRESETS, gpt_loss, preset_config
from torch import Tensor, nn

log = logging.getLogger(__name__)

LossFn = Callable[[nn.Module, Tensor, Tensor], Tensor]


class WorkloadError(ValueError):
    """A workload spec could not be resolved into a usable model and loss function."""


@dataclass
class Workload:
    """A model to train, how to score it on a batch (x, y), and its context length."""

    model: nn.Module
    loss_fn: LossFn
    block_size: int
    name: str


def build_workload(spec: str, vocab_size: int, seed: int) -> Workload:
    """Build the workload named by ``spec`` with parameters determined by ``seed``."""
    if not isinstance(spec, str) or not spec.strip():
        raise WorkloadError(f"workload spec must be a non-empty string, got {spec!r}")
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise WorkloadError(f"vocab_size must be a positive int, got {vocab_size!r}")
    spec = spec.strip()
    with torch.random.fork_rng(devices=[]):
        # The CPU generator only (models are built on the CPU): torch.manual_seed also seeds every
        # CUDA device, which fork_rng(devices=[]) does not put back, so building a scorer or a
        # scratch model reset a CUDA peer's dropout stream.
        torch.default_generator.manual_seed(seed)
        if ":" in spec:
            return _build_custom(spec, vocab_size)
        return _build_preset(spec, vocab_size)


def parameter_layout(model: nn.Module) -> str:
    """A digest of the model's parameter names, shapes and dtypes in the order they are
    flattened: peers exchange one flat vector, so two builds of one spec must agree on it."""
    h = hashlib.blake2b(digest_size=16)
    for name, p in model.named_parameters():  # (the order of `parameters()`, shared ones once)
        # Wrappers that change no parameter add to the names: torch.compile's `_orig_mod.`, and
        # DataParallel's `module.` (a factory compiling on CUDA only was refused; a review).
        name = ".".join(part for part in name.split(".") if part != "_orig_mod").removeprefix("module.")
        h.update(f"{name}\t{tuple(p.shape)}\t{p.dtype}\n".encode())
    return h.hexdigest()


def check_layout(manifest: Any, workload: Workload) -> None:
    """ConfigError unless the model built here has the parameter layout the run's manifest signed
    (another version of a custom model's code, or one whose layers are registered in an order
    that changes between processes, has the same count but trains other coordinates)."""
    from .config import ConfigError

    want = manifest.model.layout
    have = parameter_layout(workload.model)
    if want and have != want:
        raise ConfigError(f"this run's model ({manifest.model.spec}) builds here with another parameter layout than the "
                          f"coordinator's (names, shapes or order; {have}, the run's {want}): install the version of "
                          "its code the coordinator runs (a model that registers its layers in set or dict-of-"
                          "unordered order builds differently in every process)")


def check_workload_spec(spec: str) -> None:
    """WorkloadError unless `spec` names a preset or an importable `module:callable` (nothing is built)."""
    if not isinstance(spec, str) or not spec.strip():
        raise WorkloadError(f"workload spec must be a non-empty string, got {spec!r}")
    spec = spec.strip()
    if ":" in spec:
        _resolve_callable(spec)
    elif spec not in PRESETS:
        raise WorkloadError(f"unknown workload {spec!r}: expected a preset ({', '.join(PRESETS)}) or 'module:callable'")


def _build_preset(name: str, vocab_size: int) -> Workload:
    if name not in PRESETS:
        raise WorkloadError(
            f"unknown workload {name!r}: expected a preset ({', '.join(PRESETS)}) or 'module:callable'"
        )
    config = preset_config(name, vocab_size=vocab_size)
    return Workload(model=GPT(config), loss_fn=gpt_loss, block_size=config.block_size, name=name)


def _resolve_callable(spec: str) -> Callable[..., Any]:
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path:
        raise WorkloadError(f"custom workload spec must look like 'module:callable', got {spec!r}")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:  # any import-time failure of user code is a spec problem
        raise WorkloadError(f"cannot import module {module_name!r} for workload {spec!r}: {exc}") from exc
    for attr in attr_path.split("."):
        try:
            target = getattr(target, attr)
        except AttributeError as exc:
            raise WorkloadError(f"module {module_name!r} has no attribute {attr_path!r}") from exc
    if not callable(target):
        raise WorkloadError(f"{spec!r} is not callable (got {type(target).__name__})")
    return target


def _build_custom(spec: str, vocab_size: int) -> Workload:
    factory = _resolve_callable(spec)
    try:
        result = factory(vocab_size=vocab_size)
    except Exception as exc:
        raise WorkloadError(f"workload factory {spec!r} failed: {type(exc).__name__}: {exc}") from exc

    if isinstance(result, tuple):
        if len(result) not in (2, 3):
            raise WorkloadError(
                f"{spec!r} returned a tuple of length {len(result)}; "
                "expected (model, loss_fn) or (model, loss_fn, block_size)"
            )
        model, loss_fn = result[0], result[1]
        block_size = result[2] if len(result) == 3 else None
    elif all(hasattr(result, attr) for attr in ("model", "loss_fn", "block_size")):
        model, loss_fn, block_size = result.model, result.loss_fn, result.block_size
    else:
        raise WorkloadError(
            f"{spec!r} returned {type(result).__name__}; expected (model, loss_fn), "
            "(model, loss_fn, block_size) or an object with model/loss_fn/block_size"
        )

    if not isinstance(model, nn.Module):
        raise WorkloadError(f"{spec!r} returned a model of type {type(model).__name__}, not torch.nn.Module")
    if block_size is None:
        block_size = _infer_block_size(model, spec)
    if not any(p.requires_grad for p in model.parameters()):
        raise WorkloadError(f"{spec!r} returned a model with no trainable parameters")
    if not callable(loss_fn):
        raise WorkloadError(f"{spec!r} returned a loss_fn of type {type(loss_fn).__name__}, not a callable")
    # Only parameters are exchanged: running statistics that training updates (BatchNorm's and the
    # like) would stay at their start values on the coordinator and every joiner, and drift apart
    # on each volunteer, so every evaluation in eval mode would be of another model.
    tracking = [name for name, m in model.named_modules()
                if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats]
    if tracking:
        raise WorkloadError(f"{spec!r} has layers that keep running statistics ({', '.join(tracking[:3])}), which "
                            "peers do not exchange: use LayerNorm/GroupNorm, or track_running_stats=False")
    # The outer optimizers keep the global parameters in fp32: a bf16 or fp16 copy of them would
    # round every round, and that rounding would come back as a pseudo-gradient nobody trained.
    low = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.dtype != torch.float32})
    if low:
        raise WorkloadError(f"{spec!r} has {', '.join(low)} parameters: keep them float32 (train in lower "
                            "precision with torch.autocast inside the model or loss_fn)")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise WorkloadError(f"{spec!r} gave block_size {block_size!r}; expected a positive int")
    for p in model.parameters():  # (channels_last, a transposed view: the outer step flattens them)
        if not p.is_contiguous():
            p.data = p.data.contiguous()
    _refuse_trained_buffers(model, loss_fn, block_size, vocab_size, spec)
    return Workload(model=model, loss_fn=loss_fn, block_size=block_size, name=spec)


def _refuse_trained_buffers(model: nn.Module, loss_fn: Any, block_size: int, vocab_size: int, spec: str) -> None:
    """WorkloadError if training changes a floating-point buffer of the model on every step
    (spectral_norm's power-iteration vectors, say): only parameters are exchanged, so such
    buffers drift apart between peers, and the coordinator evaluates another model than the
    volunteers train (a review, 2026-12-07). A buffer filled once on first use (a cache) is fine."""
    buffers = {name: b for name, b in model.named_buffers() if b.is_floating_point()}
    if not buffers:
        return
    was_training = model.training
    n = min(block_size, 64)  # (a short batch: a large model's full block took seconds on a CPU)
    x = torch.randint(0, vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    try:
        model.train()
        with torch.no_grad():
            loss_fn(model, x, x)  # the first call may fill caches
            first = {name: b.detach().clone() for name, b in model.named_buffers() if name in buffers}
            loss_fn(model, x, x)
        moving = [name for name, b in model.named_buffers() if name in first and not _same(b, first[name])]
    except Exception as exc:  # noqa: BLE001 - a loss that needs gradients, or a model on CUDA: not checked
        log.warning("could not check whether training changes %s's buffers (%s: %s): make sure it does not, "
                    "peers do not exchange them", spec, type(exc).__name__, exc)
        moving = []
    finally:
        # (buffers are left as the probe left them: a model taken changed none on the second call,
        # so they are what its first training step leaves; put back, a cache its forward had
        # marked filled was zeros again, and it trained on them, a third review found)
        model.train(was_training)
    if moving:
        raise WorkloadError(f"{spec!r} has buffers that every training step changes ({', '.join(moving[:3])}), "
                            "which peers do not exchange: make them parameters, or compute them in forward")


def _same(a: Tensor, b: Tensor) -> bool:
    """Equal shapes and values, NaN equal to NaN (a "not computed yet" NaN is not a change)."""
    return a.shape == b.shape and bool(torch.allclose(a, b, rtol=0.0, atol=0.0, equal_nan=True))


def _infer_block_size(model: Any, spec: str) -> int:
    # A bare (model, loss_fn) pair must say its context length somewhere on the model.
    for holder in (model, getattr(model, "config", None)):
        block_size = getattr(holder, "block_size", None)
        if block_size is not None:
            return block_size
    raise WorkloadError(
        f"{spec!r} returned (model, loss_fn) but the model has no `block_size` "
        "(or `config.block_size`); set one or return (model, loss_fn, block_size)"
    )
