"""What `groundswell simulate` runs: its options, checked as flags, and the manifest they make."""

from __future__ import annotations

import json
import re
import tomllib
import unicodedata
from collections.abc import Collection
from dataclasses import InitVar, dataclass, fields

from .config import ConfigError


@dataclass
class SimulateOptions:
    """What to simulate."""

    peers: int = 4
    rounds: int = 10
    preset: str = "tiny"
    algorithm: str = "sparseloco"
    codec: str = ""
    inner_steps: int = 20
    batch_size: int = 8
    deadline_s: float = 30.0
    slack_s: float = 5.0
    min_peers: int = 2
    seed: int = 0
    outer_lr: float = 0.0
    # None, not a sentinel value, means "the default": any value given goes to the manifest, whose
    # checks refuse a bad one (read as "the default", -0.5 ran silently with 0.95, and a topk of 0 with 64).
    topk: int | None = None  # SparseLoCo: values kept per chunk (None: the manifest's default, 64 of 4096)
    error_decay: float | None = None  # SparseLoCo: error-feedback decay (None: the manifest's default, 0.95)
    overlap: int = 0  # 1: each round is exchanged while the next H steps train
    warmup_steps: int | None = None  # inner lr warmup (None: min(50, 2 H), so that short runs are not all warmup)
    checkpoint_every: int = 5
    checkpoint_keep: int = 2
    coordinator_checkpoint_every: int = 0  # `launch --checkpoint-every` (0: the manifest's cadence)
    eval_every: int = 1  # rounds between the coordinator's held-out evaluations
    timeout_s: float = 1800.0  # the driver stops the run after this long (report.json says so: `timed_out`)
    # churn (seconds; 0 = off); every choice of victim is drawn from `seed`
    kill_every: float = 0.0
    restart_after: float = 0.0  # 0: killed peers stay dead
    freeze_every: float = 0.0
    freeze_for: float = 10.0
    late_joiners: int = 0
    leave_every: float = 0.0
    kill_coordinator_at: float = 0.0
    crash_daemon_every: float = 0.0  # SIGKILL a peer's libp2p daemon (the coordinator's too): it starts a new one
    byzantine: int = 0  # the last K volunteers misbehave
    attack: str = "scale"  # see peer/byzantine.py
    defences: bool = True  # False: no norm clipping or scoring (input validation always stays on)
    scoring: bool = False  # leaders score each contribution on a probe batch and drop harmful ones
    cuda_peers: int = 0  # the first K volunteers train and encode on the GPU (`join --device cuda`)
    # The options the caller set (the CLI's flags given), for `_check_unused`; None: those whose
    # value is not the default (a flag given its default value is only seen by the CLI).
    given: InitVar[Collection[str] | None] = None

    def __post_init__(self, given: Collection[str] | None) -> None:
        from .byzantine import ATTACKS

        for name in ("peers", "rounds", "inner_steps", "batch_size", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        for name in ("kill_every", "restart_after", "freeze_every", "freeze_for", "leave_every",
                     "kill_coordinator_at", "crash_daemon_every"):
            value = getattr(self, name)
            if not value >= 0 or value == float("inf"):  # a negative period would kill on every pass
                raise ConfigError(f"--{name.replace('_', '-')} must be a finite number of seconds >= 0, got {value}")
        if not 0 < self.timeout_s < float("inf"):  # 0 would end the run before its first round
            raise ConfigError(f"--timeout must be a finite number of seconds > 0, got {self.timeout_s}")
        if self.topk is not None and self.topk < 1:  # said here: the manifest's words name outer.chunk too
            raise ConfigError(f"--topk must be at least 1, got {self.topk}")
        if self.late_joiners < 0:
            raise ConfigError(f"--late-joiners must be >= 0, got {self.late_joiners}")
        if not 0 <= self.byzantine <= self.peers:
            raise ConfigError(f"--byzantine must be between 0 and --peers ({self.peers}), got {self.byzantine}")
        if not 0 <= self.cuda_peers <= self.peers:
            raise ConfigError(f"--cuda-peers must be between 0 and --peers ({self.peers}), got {self.cuda_peers}")
        if self.attack not in ATTACKS:
            raise ConfigError(f"--attack must be one of {', '.join(ATTACKS)}, not {self.attack!r}")
        self._check_faults()
        self._check_unused(given)

    def _check_unused(self, given: Collection[str] | None) -> None:
        """Refuse an option that the others given keep from taking effect, rather than run without it."""
        if given is None:
            given = {f.name for f in fields(self) if getattr(self, f.name) != f.default}
        codec = self.codec or ("sparseloco" if self.algorithm == "sparseloco" else "fp32")
        killed = "without --kill-every or --kill-coordinator-at (only killed peers restart)"
        needs = {"restart_after": (self.kill_every or self.kill_coordinator_at, killed),
                 "freeze_for": (self.freeze_every, "without --freeze-every"),
                 "attack": (self.byzantine, "without --byzantine (no peer misbehaves)"),
                 "topk": (codec == "sparseloco", f"with the {codec} codec (--algorithm {self.algorithm})"),
                 "error_decay": (self.algorithm == "sparseloco", f"with --algorithm {self.algorithm}")}
        for name, (used, why_not) in needs.items():
            if name in given and not used:
                raise ConfigError(f"--{name.replace('_', '-')} does nothing {why_not}")

    def _check_faults(self) -> None:
        """Refuse faults that could never happen, rather than run without them and exit 0."""
        # they start once round LATE_JOIN_ROUND is applied, as faults do before the last round is under way
        if self.late_joiners and self.rounds < LATE_JOIN_ROUND + 3:
            raise ConfigError(f"--late-joiners start once round {LATE_JOIN_ROUND} is applied, and not in the last "
                              f"round: they need --rounds {LATE_JOIN_ROUND + 3} or more, got --rounds {self.rounds}")
        for name in ("kill_every", "freeze_every", "leave_every", "kill_coordinator_at", "crash_daemon_every"):
            # (see `faults_due`: from once round 0 is applied until the last round is under way)
            if getattr(self, name) and self.rounds < 3:
                raise ConfigError(f"--{name.replace('_', '-')} needs --rounds 3 or more (faults happen once round 0 "
                                  f"is applied, and not in the last round), got --rounds {self.rounds}")
        for name, what in (("kill_every", "kill"), ("freeze_every", "freeze"), ("leave_every", "send away"),
                           ("crash_daemon_every", "crash the daemon of")):
            # (a daemon crash may take the coordinator's: no fewer volunteers run)
            if getattr(self, name) and self.peers <= self.min_peers and name != "crash_daemon_every":
                raise ConfigError(f"--{name.replace('_', '-')} needs more peers than --min-peers ({self.min_peers}): "
                                  f"with --peers {self.peers} it would never {what} one")
            if getattr(self, name) >= self.timeout_s:  # the first is due that long after the start
                raise ConfigError(f"--{name.replace('_', '-')} must be shorter than --timeout ({self.timeout_s:g} s): "
                                  f"with {getattr(self, name):g} s it would never {what} one")
        if self.kill_coordinator_at >= self.timeout_s:
            raise ConfigError(f"--kill-coordinator-at must be before --timeout ({self.timeout_s:g} s): with "
                              f"{self.kill_coordinator_at:g} s it would never kill the coordinator")
        if self.freeze_every and not self.freeze_for:
            raise ConfigError(f"--freeze-for must be more than 0 seconds, got {self.freeze_for:g}: "
                              "a freeze of 0 s freezes no peer")

    def byzantine_peers(self) -> list[str]:
        """Names of the volunteers that misbehave."""
        return [f"peer-{i}" for i in range(self.peers - self.byzantine, self.peers)]


def manifest_toml(opts: SimulateOptions) -> str:
    """The run manifest a simulation launches (strings quoted as TOML basic strings: JSON's
    escapes are TOML's, so an option holding a quote cannot break the file; non-ASCII characters
    stay as they are, since TOML refuses JSON's surrogate-pair escapes)."""
    codec = f"codec = {json.dumps(opts.codec, ensure_ascii=False)}\n" if opts.codec else ""
    lr = ((f"lr = {opts.outer_lr}\n" if opts.outer_lr else "") + (f"topk = {opts.topk}\n" if opts.topk is not None else "")
          + (f"error_decay = {opts.error_decay}\n" if opts.error_decay is not None else "")
          + f"overlap = {opts.overlap}\n")
    warmup = opts.warmup_steps if opts.warmup_steps is not None else min(50, opts.inner_steps * 2)
    return (
        f'[run]\nid = "sim"\nopen = true\nmin_peers = {opts.min_peers}\nseed = {opts.seed}\n'
        f"[model]\nspec = {json.dumps(opts.preset, ensure_ascii=False)}\n[data]\nbatch_size = {opts.batch_size}\n"
        f"[inner]\nwarmup_steps = {warmup}\n"
        f"[outer]\nalgorithm = {json.dumps(opts.algorithm, ensure_ascii=False)}\ninner_steps = {opts.inner_steps}\n{codec}{lr}"
        f"[round]\ndeadline_s = {opts.deadline_s}\nslack_s = {opts.slack_s}\nmax_shards = 16\n"
        f"[checkpoint]\nevery_rounds = {opts.checkpoint_every}\nkeep = {opts.checkpoint_keep}\n"
        f"[eval]\nbatches = 4\nbatch_size = 16\nevery_rounds = {opts.eval_every}\n"
        + ("[defences]\nclip = 0.0\ntrim = 0.0\n" if not opts.defences else
           "[defences]\nscoring = true\n" + _verified(opts) if opts.scoring else "")
    )


def _verified(opts: SimulateOptions) -> str:
    """A dense codec's aggregates carry every signed contribution when leaders score: otherwise
    nobody but an aggregator holds one to score (the manifest refuses scoring without it)."""
    codec = opts.codec or ("sparseloco" if opts.algorithm == "sparseloco" else "fp32")
    return "" if codec == "sparseloco" else "verify_aggregates = true\n"


# Late joiners start once this round is applied (so that they join a run under way).
LATE_JOIN_ROUND = 2


# the manifest key each `simulate` flag sets (see `manifest_toml`)
FLAG_OF_KEY = {"run.min_peers": "--min-peers", "run.seed": "--seed", "data.batch_size": "--batch-size",
               "inner.warmup_steps": "--warmup", "outer.algorithm": "--algorithm", "outer.inner_steps": "--inner-steps",
               "outer.codec": "--codec", "outer.lr": "--outer-lr", "outer.topk": "--topk",
               "outer.error_decay": "--error-decay", "outer.overlap": "--overlap", "round.deadline_s": "--deadline",
               "checkpoint.every_rounds": "--checkpoint-every", "model.spec": "--preset"}


def in_flag_terms(message: str) -> str:
    """A manifest error about keys `simulate` sets from flags, reworded to name the flags."""
    for key, flag in FLAG_OF_KEY.items():
        pattern = rf"(?<![\w.-]){re.escape(key)}(?![\w.])"
        if re.search(pattern, message):
            message = message.removeprefix(f"{key.split('.')[0]}: ")  # "outer: outer.codec ..." -> "--codec ..."
            message = re.sub(pattern + "( = )?", flag + " ", message)
            message = message.replace(" ,", ",").replace(" :", ":").replace("  ", " ")
    return message


def check_manifest(opts: SimulateOptions) -> None:
    """Validate the manifest `opts` would launch; a ConfigError names the flag, not the manifest key."""
    from .manifest import manifest_from_mapping

    for flag, value in (("--preset", opts.preset), ("--algorithm", opts.algorithm), ("--codec", opts.codec)):
        if bad := [c for c in value if unicodedata.category(c) in ("Cc", "Cs")]:  # TOML refuses DEL, for one
            raise ConfigError(f"{flag} must not hold control characters, got {value!r} (with {bad[0]!r})")
    try:
        manifest_from_mapping(tomllib.loads(manifest_toml(opts)))
    except ConfigError as exc:
        raise ConfigError(in_flag_terms(str(exc))) from None
    except tomllib.TOMLDecodeError as exc:  # a character the check above missed: still one line, not a traceback
        raise ConfigError(f"--preset, --algorithm or --codec holds what a manifest cannot: {exc}") from None
