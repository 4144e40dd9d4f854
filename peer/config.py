"""One typed configuration tree, loaded strictly: unknown keys and ill-typed values are errors.

The sections (model, data, inner, outer, eval) are shared by `train-local` and the run manifest
(`manifest.py`); `from_mapping` turns a plain dict (parsed TOML, CLI overrides) into frozen dataclasses
and names the exact key that is wrong.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from groundswell.compression import CODEC_NAMES

T = TypeVar("T")

ALGORITHMS = ("diloco", "sparseloco", "data-parallel", "single")


class ConfigError(ValueError):
    """A configuration value or key is invalid; the message names the key."""


@dataclass(frozen=True)
class ModelSection:
    """Which model to train: a preset name (tiny, small, base, 100m) or `module:callable`."""

    spec: str = "tiny"
    # The coordinator's model's parameter layout (names, shapes and dtypes in the order they are
    # flattened; `launch` fills it in): a volunteer's build must match it, or its pseudo-gradients
    # land on other parameters than everyone else's with the same count (another version of a
    # custom model's code, layers registered in set order). "" where unknown (made by hand).
    layout: str = ""

    def __post_init__(self) -> None:
        _hex_digest(self.layout, "model.layout")


@dataclass(frozen=True)
class DataSection:
    """Where tokens come from and how many each inner step consumes."""

    source: str = "stdlib"  # "stdlib", a folder of text files, or a folder with train.bin/val.bin
    batch_size: int = 16
    # The coordinator's copy's fingerprint (files and sizes; `launch` fills it in): a volunteer's
    # --data must match it. "" where unknown (a manifest made by hand, with nothing checked).
    fingerprint: str = ""

    def __post_init__(self) -> None:
        _positive(self, "batch_size", "data")
        _at_most(self, "batch_size", MAX_BATCH, "data")
        if not self.source.strip():  # Path("") is the current folder: a run's own files would be its data
            raise ConfigError('data.source must name "stdlib" or a folder, got an empty string')
        _hex_digest(self.fingerprint, "data.fingerprint")


@dataclass(frozen=True)
class InnerSection:
    """The inner optimizer: AdamW with linear warmup, then cosine decay to `min_lr_ratio` over a
    known number of steps (`train-local --steps`). A swarm has no end step: its volunteers keep
    the peak learning rate after warmup, and `min_lr_ratio` does not apply there."""

    lr: float = 3e-3
    weight_decay: float = 0.1  # on matrices and embeddings; gains and biases (1-D) are not decayed
    beta1: float = 0.9
    beta2: float = 0.95
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0  # 0 disables clipping

    def __post_init__(self) -> None:
        _positive(self, "lr", "inner")
        for name in ("beta1", "beta2"):  # AdamW refuses 1 (every volunteer would fail as it builds it)
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"inner.{name} must be in [0, 1), got {getattr(self, name)}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"inner.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        for name in ("warmup_steps", "weight_decay", "grad_clip"):  # one key per message: the one that is wrong
            if getattr(self, name) < 0:
                raise ConfigError(f"inner.{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class OuterSection:
    """The outer algorithm, its codec and its round length H (inner steps per round)."""

    algorithm: Literal["diloco", "sparseloco", "data-parallel", "single"] = "diloco"
    inner_steps: int = 20
    codec: str = ""  # "" = the algorithm's default: fp32 for DiLoCo, sparseloco for SparseLoCo
    lr: float = 0.0  # 0 = the algorithm's default: 0.7 (DiLoCo), 1.0 (SparseLoCo)
    momentum: float = 0.9
    error_decay: float = 0.95
    chunk: int = 4096
    topk: int = 64
    overlap: int = 0  # rounds the outer step is delayed: 0 = wait for it, 1 = train on while it is exchanged
    # SparseLoCo with overlap: train on from the global parameters our own payload would give
    # (optim/sparseloco.py, "eager start") rather than from the raw local progress.
    eager: bool = True

    def __post_init__(self) -> None:
        _positive(self, "inner_steps", "outer")
        if self.overlap not in (0, 1):
            raise ConfigError(f"outer.overlap must be 0 (wait) or 1 (overlap one round), got {self.overlap}")
        if self.codec and self.codec not in CODEC_NAMES:
            raise ConfigError(f"outer.codec must be one of {sorted(CODEC_NAMES)}, got {self.codec!r}")
        if self.codec == "sparseloco" and self.algorithm != "sparseloco":
            # Top-k keeps 1/64 of the values; only SparseLoCo's error feedback carries the rest to
            # later rounds. Any other algorithm would silently drop ~98% of every contribution.
            raise ConfigError(f"outer.codec = 'sparseloco' needs outer.algorithm = 'sparseloco' (its error "
                              f"feedback keeps what top-k leaves out), not {self.algorithm!r}")
        if self.lr < 0:
            raise ConfigError(f"outer.lr must be >= 0, got {self.lr}")
        if not 0 <= self.error_decay <= 1:
            raise ConfigError(f"outer.error_decay must be in [0, 1], got {self.error_decay}")
        if not 0 <= self.momentum < 1:  # Nesterov momentum of 1 or more never forgets: the outer step diverges
            raise ConfigError(f"outer.momentum must be in [0, 1), got {self.momentum}")
        from groundswell.compression import CodecError
        from groundswell.compression.sparseloco import check_sparseloco_options

        try:
            check_sparseloco_options(self.chunk, self.topk)
        except CodecError as exc:
            raise ConfigError(f"outer.chunk / outer.topk: {exc}") from None

    @property
    def codec_name(self) -> str:
        """The codec in effect, defaults resolved."""
        return self.codec or ("sparseloco" if self.algorithm == "sparseloco" else "fp32")

    @property
    def lr_value(self) -> float:
        """The outer learning rate in effect, defaults resolved."""
        return self.lr or (1.0 if self.algorithm == "sparseloco" else 0.7)


@dataclass(frozen=True)
class EvalSection:
    """Held-out evaluation: a fixed set of batches, identical for every worker."""

    batches: int = 8
    batch_size: int = 16
    every_rounds: int = 1
    # In a swarm run the coordinator evaluates and publishes the loss; volunteers evaluate too
    # only if this is set (an evaluation on the trainer thread is compute not spent training).
    volunteers: bool = False

    def __post_init__(self) -> None:
        for name in ("batches", "batch_size", "every_rounds"):
            _positive(self, name, "eval")
        _at_most(self, "batch_size", MAX_BATCH, "eval")
        if self.batches * self.batch_size > MAX_EVAL_WINDOWS:  # every held-out window is built up front
            raise ConfigError(f"eval.batches x eval.batch_size must be at most {MAX_EVAL_WINDOWS} windows, got "
                              f"{self.batches} x {self.batch_size}")


@dataclass(frozen=True)
class TrainLocalConfig:
    """`groundswell train-local`: several workers in one process with the in-process exchange."""

    workers: int = 4
    steps: int = 200  # inner steps per worker
    seed: int = 0
    device: str = "cpu"
    name: str = ""
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    inner: InnerSection = field(default_factory=InnerSection)
    outer: OuterSection = field(default_factory=OuterSection)
    eval: EvalSection = field(default_factory=EvalSection)

    def __post_init__(self) -> None:
        _positive(self, "workers")
        _positive(self, "steps")
        if not 0 <= self.seed < 2**63:  # (torch's seed is a 64-bit integer; the manifest's run.seed alike)
            raise ConfigError(f"seed must be in [0, 2**63), got {self.seed}")
        if self.outer.algorithm == "single" and self.workers != 1:
            raise ConfigError("outer.algorithm 'single' trains one worker; set workers = 1")


MAX_BATCH = 1 << 14  # sequences per batch: far past any device's memory, short of hanging the data loader
MAX_EVAL_WINDOWS = 1 << 16  # held-out windows, all built at start by every peer (the default is 128)


def _at_most(obj: object, name: str, limit: int, section: str = "") -> None:
    value = getattr(obj, name)
    if value > limit:
        raise ConfigError(f"{_join(section, name)} must be at most {limit}, got {value!r}")


def _positive(obj: object, name: str, section: str = "") -> None:
    value = getattr(obj, name)
    if not value > 0:
        raise ConfigError(f"{_join(section, name)} must be positive, got {value!r}")


def from_mapping(cls: type[T], data: Mapping[str, Any], where: str = "") -> T:
    """Build dataclass `cls` from a mapping, rejecting unknown keys and ill-typed values."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where or 'config'} must be a table, got {type(data).__name__}")
    fields_by_name = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields_by_name))
    if unknown:
        raise ConfigError(f"unknown key {_join(where, unknown[0])!r}; known keys: {', '.join(fields_by_name)}")
    hints = typing.get_type_hints(cls)
    kwargs = {name: _coerce(hints[name], value, _join(where, name)) for name, value in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        message = str(exc)
        if where and not message.startswith(f"{where}."):  # "outer: outer.lr ..." would say it twice
            message = f"{where}: {message}"
        raise ConfigError(message) from None


def replace_path(cfg: T, dotted: str, value: Any, _above: str = "") -> T:
    """Return a copy of `cfg` with one dotted key (e.g. "outer.lr") set, type-checked."""
    head, _, rest = dotted.partition(".")
    if not dataclasses.is_dataclass(cfg) or head not in {f.name for f in dataclasses.fields(cfg)}:
        # also below a plain value (workers.x, workers being an int)
        raise ConfigError(f"unknown key {_join(_above, dotted)!r}")
    if rest:
        inner = replace_path(getattr(cfg, head), rest, value, _join(_above, head))
        return dataclasses.replace(cfg, **{head: inner})  # type: ignore
    hint = typing.get_type_hints(type(cfg))[head]
    return dataclasses.replace(cfg, **{head: _coerce(hint, value, _join(_above, dotted))})  # type: ignore


def set_path(data: dict[str, Any], cls: type, dotted: str, value: Any, _above: str = "") -> None:
    """Set one dotted key (e.g. "outer.lr") in a plain config mapping, in place, if `cls` has that key.

    Overrides are merged into one mapping this way and validated once by `from_mapping`: applied
    one by one to the typed config, each would be checked against the values not yet overridden
    (`--algorithm diloco --codec fp32` over a sparseloco file failed on the first flag)."""
    head, _, rest = dotted.partition(".")
    if not dataclasses.is_dataclass(cls) or head not in {f.name for f in dataclasses.fields(cls)}:
        # also below a plain value (workers.x, workers being an int)
        raise ConfigError(f"unknown key {_join(_above, dotted)!r}")
    if not rest:
        data[head] = value
        return
    below = data.get(head, {})
    if not isinstance(below, Mapping):
        raise ConfigError(f"{_join(_above, head)} must be a table, got {type(below).__name__}")
    data[head] = below = dict(below)  # a copy: the caller's nested tables are left as they were
    set_path(below, typing.get_type_hints(cls)[head], rest, value, _join(_above, head))


def _hex_digest(value: str, key: str) -> None:
    """ConfigError unless `value` is "" or lowercase hex of at most 64 digits."""
    if value and not (len(value) <= 64 and all(c in "0123456789abcdef" for c in value)):
        raise ConfigError(f"{key} must be lowercase hex (at most 64 digits), got {value!r}")


def to_mapping(cfg: object) -> dict[str, Any]:
    """The config as plain nested dicts (for reports and manifests)."""
    return dataclasses.asdict(cfg)  # type: ignore[call-overload]


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _coerce(hint: Any, value: Any, where: str) -> Any:
    if dataclasses.is_dataclass(hint):
        return from_mapping(hint, value, where)
    origin = typing.get_origin(hint)
    if origin is Literal:
        if value not in typing.get_args(hint):
            raise ConfigError(f"{where} must be one of {list(typing.get_args(hint))}, got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(hint):
            try:
                return _coerce(arg, value, where)
            except ConfigError:
                continue
        raise ConfigError(f"{where} has the wrong type: {value!r}")
    if hint is type(None):
        if value is not None:
            raise ConfigError(f"{where} must be empty")
        return None
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        try:
            number = float(value)
        except OverflowError:  # an integer of hundreds of digits (not quoted: it may be too long to print)
            raise ConfigError(f"{where} is out of range: too large for a floating-point number") from None
        if not math.isfinite(number):  # a NaN or infinite learning rate would silently ruin the run
            raise ConfigError(f"{where} must be a finite number, got {number}")
        return number
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string, got {value!r}")
        return value
    raise ConfigError(f"{where}: unsupported config type {hint!r}")  # a bug in this module, not the user's


def check_device(device: str, probe: bool = True) -> None:
    """A device torch knows and this machine has (cpu, cuda, cuda:N), checked before anything starts.
    `probe`: run one kernel on it (not in a process that only starts others: it would hold a CUDA
    context, and the device itself in exclusive-process mode, for its whole life)."""
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"--device must be cpu, cuda or cuda:N, not {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device must be cpu, cuda or cuda:N, not {device!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {device} was asked for, but torch sees no CUDA device")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"--device {device}: torch sees only {torch.cuda.device_count()} CUDA device(s)")
        try:  # a GPU this torch build has no kernels for, or one held in exclusive-process mode
            if probe:
                torch.ones(1, device=dev).add_(1).cpu()
        except RuntimeError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(f"--device {device}: torch cannot run on it ({first}); is it busy, or is this torch "
                              "built for it? (another --device works too)") from None
