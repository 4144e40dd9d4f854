"""Rules of a run manifest that span its sections, and settings a launch refuses because they
would do nothing (a reviewer found each of these accepted, signed, and then stalling the run).

`check_limits` runs on every manifest, signed ones included; `refuse_unused` only where a
coordinator wrote the TOML (a signed manifest lists every key, defaults included).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from groundswell.protocol.shards import max_members

from .config import ConfigError

if TYPE_CHECKING:
    from .manifest import RunManifest

# defences.requests_per_s: a peer's requests to one other peer in a round come in bursts (its
# shards and their replicas, reports, claims, seals, fetches); the guard lets 2 s worth through
# at once and counts each refusal as a strike. At 2 per second honest peers banned each other
# (a live run stalled at round 1); the default is 50.
MIN_REQUESTS_PER_S = 20.0
# defences.max_clock_skew_s: under a few seconds, honest peers' clocks (NTP keeps them within
# well under a second) and a message's time in flight are refused; over an hour, a commit's time
# and a nonce's replay window mean little.
MIN_CLOCK_SKEW_S, MAX_CLOCK_SKEW_S = 5.0, 3600.0
# defences.score_batches: every leader builds that many probe batches at once, in memory
MAX_SCORE_BATCHES = 64


def check_limits(m: RunManifest) -> None:
    """ConfigError unless the sections fit together: a run whose every round could only retry
    (too few possible contributors or members) or whose defences refuse honest peers."""
    d = m.defences
    if not d.requests_per_s >= MIN_REQUESTS_PER_S:
        raise ConfigError(f"defences.requests_per_s must be at least {MIN_REQUESTS_PER_S:g} (honest peers' bursts "
                          f"in one round are refused below it, and refusals get them banned), got {d.requests_per_s}")
    if not MIN_CLOCK_SKEW_S <= d.max_clock_skew_s <= MAX_CLOCK_SKEW_S:
        raise ConfigError(f"defences.max_clock_skew_s must be in [{MIN_CLOCK_SKEW_S:g}, {MAX_CLOCK_SKEW_S:g}] s, "
                          f"got {d.max_clock_skew_s}")
    if d.score_batches > MAX_SCORE_BATCHES:
        raise ConfigError(f"defences.score_batches must be at most {MAX_SCORE_BATCHES} (every leader builds them "
                          f"at once), got {d.score_batches}")
    members = max_members(m.round.max_shards)
    if members < max(2, m.run.min_peers):
        raise ConfigError(f"round.max_shards = {m.round.max_shards} lets a round have {members} members (a commit "
                          f"names each contributor's digest per shard), fewer than "
                          f"{'run.min_peers' if m.run.min_peers >= 2 else 'two'}: no round could commit")
    if not m.run.open and m.run.min_peers > len(m.run.allowlist):
        n = len(m.run.allowlist)
        raise ConfigError(f"run.min_peers = {m.run.min_peers}, but run.allowlist names only {n} peer{'s' * (n != 1)} "
                          "that may contribute (the coordinator does not train): no round could commit")


def refuse_unused(data: Mapping[str, Any], m: RunManifest) -> None:
    """ConfigError for a key the manifest's other settings keep from taking effect (as `simulate`
    refuses such options), rather than a run signed with a setting that silently does nothing."""
    outer, defences = data.get("outer") or {}, data.get("defences") or {}
    sparse_codec, sparse = m.outer.codec_name == "sparseloco", m.outer.algorithm == "sparseloco"
    unused = {"outer.topk": ("topk" in outer and not sparse_codec, f"with the {m.outer.codec_name} codec"),
              "outer.chunk": ("chunk" in outer and not sparse_codec, f"with the {m.outer.codec_name} codec"),
              "outer.error_decay": ("error_decay" in outer and not sparse, f"with outer.algorithm = "
                                    f"{m.outer.algorithm!r} (it has no error feedback)"),
              "outer.momentum": ("momentum" in outer and sparse, "with outer.algorithm = 'sparseloco' (its outer "
                                 "step is plain SGD)"),
              "outer.eager": ("eager" in outer and not (sparse and m.outer.overlap == 1),
                              "unless outer.algorithm = 'sparseloco' and outer.overlap = 1"),
              "defences.score_threshold": ("score_threshold" in defences and not m.defences.scoring,
                                           "without defences.scoring = true"),
              "defences.score_batches": ("score_batches" in defences and not m.defences.scoring,
                                         "without defences.scoring = true")}
    for key, (refused, why) in unused.items():
        if refused:
            raise ConfigError(f"{key} does nothing {why}; leave it out")
