"""report.json of a simulation, from every process's event log and the driver's own events.

Fault metrics: `recovery_s` (per kill or freeze: seconds until the swarm next completes a round:
without that peer, or with it once it is back), `recovery_excluding_s` (the stricter reading:
seconds until a round completes that leaves that peer out; a peer that restarts in time for the
round it died in is in the next rounds too, so this grows the faster peers come back;
`recovery_unmeasured` counts the faults either list leaves out, no such round having ended after
them), `rejoin_s` (per restart or late join: seconds until that peer's first contribution is
in an aggregate), `lost_contributions` (a contribution whose work went wrong:
counted in a committed round while its owner kept its work, so applied twice, or taken out of
its owner's work while the commit left it out, so never applied; one that a crashed process sent
and its restart cannot count as its own is not lost), `double_counted_contributions` (those of
them applied twice), `presumed_lost_contributions` (those of them a restarted process took out of
its work as counted, by design, because it could not check the commit, which had not counted them), the per-round parameter-hash agreement over every process (and in how many
rounds two or more processes reported a hash to compare: `hash_checked_rounds`; a process that finished
a round without one, `unhashed`, and a round nobody reported one for, `hashless_rounds`, make it
false: see sim_rounds.py), whether the
driver's timeout stopped the run (`timed_out`) or Ctrl+C or a signal did (`interrupted`), and where each process ended (`final_round_by_process`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from .event_log import NONFINITE
from .sim_rounds import read_rounds, round_times

if TYPE_CHECKING:
    from .sim_options import SimulateOptions

# the options that schedule faults, as report.json's `faults` gives them
FAULT_OPTIONS = ("kill_every", "restart_after", "freeze_every", "freeze_for", "leave_every", "late_joiners",
                 "kill_coordinator_at", "crash_daemon_every")


def _down_spans(driver_events: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """Per process name, the driver-time spans it was frozen (freeze to thaw) or gone (kill or
    leave to its restart); a span the run never closed ends at infinity."""
    ends = {"freeze": ("thaw",), "kill": ("restart",), "leave": ("restart",)}
    spans: dict[str, list[tuple[float, float]]] = {}
    for i, ev in enumerate(driver_events):
        if ev["kind"] in ends:
            end = next((d["t"] for d in driver_events[i + 1:]
                        if d["peer"] == ev["peer"] and d["kind"] in ends[ev["kind"]]), math.inf)
            spans.setdefault(ev["peer"], []).append((ev["t"], end))
    return spans


def read_events(path: Path) -> list[dict]:
    """One events file (missing file: none; a line cut short by a kill is skipped)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a kill; the rest of the log still counts
    return out


def read_state_dir_events(state_dir: Path) -> list[dict]:
    """Every event a state dir still holds, oldest first: events.jsonl.1 (event_log.py renames a
    full log so, replacing the one before), then events.jsonl; each read on its own, so that a
    line a kill cut short at the end of one is not glued to the next one's first."""
    return read_events(state_dir / "events.jsonl.1") + read_events(state_dir / "events.jsonl")


def build_report(out: Path, opts: "SimulateOptions", driver_events: list[dict], wall_s: float,
                 t0: float | None = None, rss: dict[str, float] | None = None) -> dict:
    """report.json from the processes' event logs and the driver's own events."""
    from .workload import build_workload

    params = sum(p.numel() for p in build_workload(opts.preset, 256, opts.seed).model.parameters())
    # the rotated part too: without it a long run lost its early rounds, and its bytes per round
    # were a whole run's totals over the later rounds only
    logs = {d.name: read_state_dir_events(d) for d in sorted(out.iterdir())
            if d.is_dir() and any((d / f).exists() for f in ("events.jsonl", "events.jsonl.1"))}
    if t0 is None:
        t0 = min((e["t"] for evs in logs.values() for e in evs), default=0.0)
    cut = [e["t"] for e in driver_events if e["kind"] in ("timed-out", "interrupted")]
    if cut:  # what the run did by its timeout or interruption: processes still running may go on a while
        logs = {name: [e for e in evs if e["t"] - t0 <= cut[0]] for name, evs in logs.items()}
    ids = {name: next((e["peer"] for e in evs if "peer" in e), name) for name, evs in logs.items()}
    rounds = [dict(e, who=name) for name, evs in logs.items() for e in evs if e["kind"] == "round"]
    rs = read_rounds(logs, t0, opts.eval_every)
    end_t, loss, contributors = rs.end_t, rs.loss, rs.contributors
    # Where each process ended: the last round it applied (in a round or in catching up) and the
    # hash it then held. Per-round agreement says nothing of a process that stopped early.
    # A downloaded state of round s is where round s - 1 left the swarm.
    final: dict[str, list] = {}
    for name, evs in logs.items():
        applied = [(e["round"] - (e["kind"] == "sync"), e["t"], e["hash"]) for e in evs
                   if e["kind"] in ("round", "follow", "sync") and e.get("hash")]
        if applied:
            r, _, digest = max(applied)
            final[name] = [r, digest]
    volunteer_rounds = [e for e in rounds if e["who"] != "coordinator"]
    lost, twice, presumed = _misapplied(logs, volunteer_rounds, contributors)
    order = sorted(end_t)
    # Rounds are numbered from 0 in a simulation; one no process logged (e.g. every holder of its
    # aggregate died, so the others re-synced past it) still happened, and keeps its place as None.
    completed = rs.completed
    events = list(driver_events) + [
        {"t": round(e["t"] - t0, 3), "kind": e["kind"], "peer": name}
        for name, evs in logs.items() for e in evs if e["kind"] not in ("round", "train", "follow")
    ]
    recovery, excluding, rejoin, never_rejoined, crash_rejoin = [], [], [], 0, []
    unmeasured = {"recovery": 0, "recovery_excluding": 0}  # faults no later round measured (said, not hidden)
    for ev in driver_events:
        pid = ids.get(ev["peer"])
        # The earliest end after the fault, not the next round's: a round known only from a late
        # catch-up can end after a later round did.
        if ev["kind"] == "daemon-crash":  # the same process starts a new daemon: back once counted again
            ended = min((d["t"] for d in driver_events if d["peer"] == ev["peer"] and d["t"] > ev["t"]
                         and d["kind"] in ("kill", "leave", "freeze", "daemon-crash", "kill-coordinator", "restart")),
                        default=math.inf)
            evs = logs.get(ev["peer"], [])
            # rounds of the new node's only: the old one may log a round whose result it held
            # already, after the kill and before it noticed
            back = min((e["t"] - t0 for e in evs if e["kind"] == "network-restart" and e["t"] - t0 > ev["t"]),
                       default=math.inf)
            after = [e["t"] - t0 for e in evs if e["kind"] == "round" and back < e["t"] - t0 <= ended
                     and (e.get("included") is True or ev["peer"] == "coordinator")]  # (it follows rounds)
            crash_rejoin.append(round(min(after) - ev["t"], 2) if after else None)
        if ev["kind"] in ("kill", "freeze", "daemon-crash"):
            after = [end_t[r] for r in order if end_t[r] > ev["t"]]
            if after:
                recovery.append(round(min(after) - ev["t"], 2))
            else:
                unmeasured["recovery"] += 1
            after = [end_t[r] for r in order if end_t[r] > ev["t"] and r in contributors and pid not in contributors[r]]
            if after:
                excluding.append(round(min(after) - ev["t"], 2))
            else:
                unmeasured["recovery_excluding"] += 1
        elif ev["kind"] in ("restart", "join") and ev["peer"] != "coordinator":  # (it contributes nothing)
            # The (re)started process's own word that a commit counted its work: a commit naming the
            # peer may count what its killed process sent before it died (`superseded`). Only within
            # that process's life: a restart killed again before it was counted never rejoined (it
            # was credited with its successor's first counted round, found by a review).
            ended = min((d["t"] for d in driver_events if d["peer"] == ev["peer"] and d["t"] > ev["t"]
                         and d["kind"] in ("kill", "restart", "leave")), default=math.inf)
            after = [e["t"] - t0 for e in logs.get(ev["peer"], [])
                     if e["kind"] == "round" and e.get("included") is True and ev["t"] < e["t"] - t0 <= ended]
            if after:
                rejoin.append(round(min(after) - ev["t"], 2))
            else:
                never_rejoined += 1
    outages = _coordinator_outages(driver_events, logs.get("coordinator", []), end_t, t0)
    n = opts.peers
    # Compute utilization: time in forward/backward/inner optimizer over each volunteer's wall time
    # from its first sync to the end of its last block of inner steps, less the time the driver
    # held it frozen or dead (a fault is not the swarm's overhead; rejoining after one is).
    utilization = []
    down = _down_spans(driver_events)
    for name, evs in logs.items():
        blocks = [e for e in evs if e["kind"] == "train"]
        first = min((e["t"] for e in evs if e["kind"] == "sync"), default=None)
        if name != "coordinator" and blocks and first is not None and blocks[-1]["t"] > first:
            last = blocks[-1]["t"]
            held = sum(max(0.0, min(b + t0, last) - max(a + t0, first)) for a, b in down.get(name, ()))
            if last - first - held > 0:
                utilization.append(min(1.0, sum(e["compute_s"] for e in blocks) / (last - first - held)))
    rejected: dict[str, int] = {}  # contributions refused by aggregators, by reason
    for evs in logs.values():
        for e in evs:
            if e["kind"] == "defences":
                for key, count in e["rejected"].items():
                    reason, _, handler = key.partition(":")
                    if handler == "contribute":
                        rejected[reason] = rejected.get(reason, 0) + count
    names = {pid: name for name, pid in ids.items()}
    clipped: dict[str, int] = {}  # shards in which each peer's contribution was clipped, as the coordinator applied them
    shards_total = 0  # shards of every round the coordinator applied
    for e in logs.get("coordinator", []):
        if e["kind"] == "round" and isinstance(e.get("clipped"), dict):
            shards_total += e.get("shards", 0)
            for pid, count in e["clipped"].items():
                clipped[names.get(pid, pid)] = clipped.get(names.get(pid, pid), 0) + count
    dropped: dict[str, set[int]] = {}  # peer name -> rounds in which a leader's scoring dropped its contribution
    for evs in logs.values():
        for e in evs:
            if e["kind"] == "scores":
                for pid, score in e["scores"].items():
                    score = NONFINITE.get(score, score) if isinstance(score, str) else score  # (NaN: dropped too)
                    if not score <= e.get("threshold", 0.0):
                        dropped.setdefault(names.get(pid, pid), set()).add(e["round"])
    starts = [e["t"] - t0 for evs in logs.values() for e in evs if e["kind"] == "sync"]
    return {
        "peers": n,
        "rounds_target": opts.rounds,
        "seed": opts.seed,  # every fault's victim is drawn from it (simulate.py `fault_pick`)
        "faults": {name: getattr(opts, name) for name in FAULT_OPTIONS},  # as asked for
        "faults_fired": {kind: sum(1 for e in driver_events if e["kind"] == kind) for kind in FAULT_KINDS.values()},
        # faults due that took nobody: no more than --min-peers up, running and not frozen (`fault_victims`)
        "faults_held_back": {kind: sum(1 for e in driver_events if e["kind"] == f"{kind}-held-back")
                             for kind in ("kill", "freeze", "leave", "daemon-crash")},
        "cuda_peers": opts.cuda_peers,  # peer-0 .. peer-(K-1) trained on the GPU
        "rounds_completed": completed,
        "codec": opts.codec or ("sparseloco" if opts.algorithm == "sparseloco" else "fp32"),
        "algorithm": opts.algorithm,
        "params": params,
        # the newest round with a finite held-out loss: it may be earlier than the last round
        # completed (not evaluated there, or not finite: see `eval_nonfinite_rounds`)
        "final_eval_loss": loss[max(loss)] if loss else None,
        "final_eval_round": max(loss) if loss else None,
        "eval_nonfinite_rounds": rs.nonfinite,  # evaluated, and the loss was NaN or infinite
        "eval_loss_by_round": [loss.get(r) for r in range(completed)],
        "round_end_t": [round(end_t[r], 3) if r in end_t else None for r in range(completed)],
        "bytes_sent_per_peer_per_round": _sent_per_round(logs, volunteer_rounds),
        # of those, the states volunteers served to (re)joining peers: in a churn run they can
        # outweigh the rounds' own exchange (None: logs of a version that did not count them)
        "state_bytes_sent_per_peer_per_round": _sent_per_round(logs, volunteer_rounds, "state_sent_total"),
        "coordinator_bytes_sent_per_round": _coordinator_sent_per_round(logs.get("coordinator", []), completed),
        "dense_fp32_ring_bytes_per_peer_per_round": 2 * (n - 1) / n * 4 * params,
        # for every round, all processes that finished it had the same hash (sim_rounds.py `Rounds.agreement`)
        "param_hash_agreement": rs.agreement,
        # rounds whose hash two or more processes reported: only those are compared at all
        "hash_checked_rounds": sum(1 for who in rs.reporters.values() if len(who) >= 2),
        "divergent_rounds": rs.divergent,
        # {round, peer}: a process that finished a round and logged no hash for it (agreement: false)
        "unhashed": rs.unhashed,
        # completed rounds no process reported a hash for (agreement: false; none was compared)
        "hashless_rounds": rs.hashless,
        "final_round_by_process": dict(sorted(final.items())),  # name -> [last round applied, its hash]
        # a peer that found its hash off the coordinator's and re-synced (counted, not hidden)
        "hash_mismatches": sum(1 for evs in logs.values() for e in evs if e["kind"] == "hash-mismatch"),
        "round_times_s": round_times(min(starts) if starts else None, end_t, completed),
        "wall_s": round(wall_s, 2),
        "recovery_s": recovery,
        "recovery_excluding_s": excluding,
        # kills and freezes left out of the two lists above: no round of that kind ended after them
        "recovery_unmeasured": unmeasured,
        "rejoin_s": rejoin,
        "coordinator_outages": outages,  # per --kill-coordinator-at: the swarm's next round, the coordinator's return
        "never_rejoined": never_rejoined,  # restarts and late joins whose process was never counted
        # per --crash-daemon-every crash: seconds until the peer was counted in a round again (None: never)
        "daemon_crash_rejoin_s": crash_rejoin,
        "network_restarts": sum(1 for evs in logs.values() for e in evs if e["kind"] == "network-restart"),
        # rounds fewer than two processes reported a hash for: nothing compared them
        "unchecked_rounds": rs.unchecked,
        "lost_contributions": lost,
        "double_counted_contributions": twice,  # of `lost_contributions`, those applied twice
        # of `lost_contributions`, those a restart presumed counted (it could not check the commit)
        "presumed_lost_contributions": presumed,
        "timed_out": any(e["kind"] == "timed-out" for e in driver_events),  # stopped by the driver's timeout
        # stopped by Ctrl+C or a signal (not one that only skipped the final wait for the coordinator,
        # the run over: `stop-wait-skipped` in `events`)
        "interrupted": any(e["kind"] == "interrupted" for e in driver_events),
        "crashed": sorted({e["peer"] for e in driver_events if e["kind"] == "crash"}),  # ended with an error
        "compute_utilization": round(sum(utilization) / len(utilization), 4) if utilization else None,
        "overlap": opts.overlap,
        "peak_rss_mb_per_peer": {k: round(v, 1) for k, v in (rss or {}).items()},
        "byzantine": {"peers": opts.byzantine_peers(), "attack": opts.attack if opts.byzantine else None},
        "defences": ("on+scoring" if opts.scoring else "on") if opts.defences else "off",
        "dropped_by_scoring": {k: len(v) for k, v in sorted(dropped.items())},  # rounds dropped, per peer
        "rejected_contributions": rejected,
        # how often each peer's contribution was norm-clipped: shards clipped, of `shards_applied` in all
        "clipped_shards": dict(sorted(clipped.items())),
        "shards_applied": shards_total,
        "events": sorted(events, key=lambda e: e["t"]),
    }


def _coordinator_outages(driver_events: list[dict], coordinator_log: list[dict], end_t: dict[int, float],
                         t0: float) -> list[dict]:
    """Per coordinator kill: when (`at_s`), seconds until the swarm next ended a round without it
    (`next_round_s`), and until the restarted coordinator applied a round of its own again, past
    its catch-up (`back_in_step_s`); None where the run ended first."""
    outages = []
    for ev in driver_events:
        if ev["kind"] != "kill-coordinator":
            continue
        nxt = min((t for t in end_t.values() if t > ev["t"]), default=None)
        back = min((e["t"] - t0 for e in coordinator_log if e["kind"] == "round" and e["t"] - t0 > ev["t"]),
                   default=None)
        outages.append({"at_s": round(ev["t"], 2), "next_round_s": None if nxt is None else round(nxt - ev["t"], 2),
                        "back_in_step_s": None if back is None else round(back - ev["t"], 2)})
    return outages


def _misapplied(logs: dict[str, list[dict]], volunteer_rounds: list[dict],
                contributors: dict[int, set[str]]) -> tuple[int, int, int]:
    """Contributions whose work went wrong, as (all of them, those applied twice, those presumed
    counted by a restart that could not check the commit, which had not): each owner's
    reading of a commit against the commit's contributors."""
    lost = twice = presumed = 0
    for e in volunteer_rounds:
        # A commit that names a peer but counts what its crashed process sent (`superseded`) loses
        # nothing: that contribution was applied, and the restarted process keeps its own work.
        counted = e["peer"] in contributors[e["round"]]
        if bool(e.get("included")) != counted and not e.get("superseded"):
            lost += 1
            twice += counted  # counted, and its work kept
    # Contributions settled after their round (volunteer_loop.py `_settle_one`) without knowing the commit:
    # `outcome-unknown` kept the work, `presumed-counted` took it out. Only the commit says which
    # was right. A peer's settlings of one round are read as one (a commit names a peer once, and
    # an earlier process's settling died with it): the latest.
    counted_elsewhere = {(e["peer"], e["round"]) for e in volunteer_rounds if e.get("included") is True}
    settled: dict[tuple[str, int], str] = {}
    for e in sorted((e for evs in logs.values() for e in evs
                     if e["kind"] in ("outcome-unknown", "presumed-counted", "included-late")), key=lambda e: e["t"]):
        settled[(e["peer"], e["round"])] = e["kind"]
    for (pid, r), kind in settled.items():
        if r not in contributors:  # no log holds the round's commit: nothing to compare with
            continue
        # the peer is named, and no other contribution of its (one its round event says counted) is why
        counted = pid in contributors[r] and (pid, r) not in counted_elsewhere
        if kind == "outcome-unknown" and counted:
            lost, twice = lost + 1, twice + 1
        elif kind == "presumed-counted" and not counted:
            lost, presumed = lost + 1, presumed + 1
    return lost, twice, presumed


def report_json(report: dict) -> str:
    """report.json's text: strict JSON (a NaN or infinity, which `build_report` never puts there,
    is an error rather than a token that strict readers refuse)."""
    return json.dumps(report, indent=2, allow_nan=False)


def _sent_total(evs: list[dict], key: str = "sent_total") -> int | None:
    """What one state dir's processes sent in all: each process's last `sent_total` (what it served
    after its last round included), summed over its restarts (None: no totals logged). `key`
    "state_sent_total": of that, the states it served to joiners."""
    total, last, seen = 0, 0, False
    for e in evs:
        if e["kind"] == "network":  # a (re)started process: its counters start again from 0
            total, last = total + last, 0
        elif isinstance(e.get(key), int):
            last, seen = max(last, e[key]), True
    return total + last if seen else None


def _sent_per_round(logs: dict[str, list[dict]], volunteer_rounds: list[dict], key: str = "sent_total"
                    ) -> float | None:
    """What volunteers sent in all over the rounds they applied (the coordinator's bytes are not
    in it, see `_coordinator_sent_per_round`). Frames on libp2p streams and state served over the
    direct TCP port (`traffic()` in swarm.py); the DHT's own traffic is not counted. Logs without
    totals: the mean of the round windows (None for `key` "state_sent_total": not logged; None also
    when no volunteer applied a round: nothing was measured, which is not 0 bytes)."""
    if not volunteer_rounds:
        return None
    totals = [_sent_total(evs, key) for name, evs in logs.items() if name != "coordinator"]
    if all(t is None for t in totals):
        if key != "sent_total":
            return None
        return sum(e["bytes_sent"] for e in volunteer_rounds) / len(volunteer_rounds)
    return sum(t or 0 for t in totals) / len(volunteer_rounds)


def _coordinator_sent_per_round(evs: list[dict], completed: int) -> float | None:
    """What the coordinator sent in all (it serves aggregate shards and state), across its restarts,
    over the rounds completed; counted as in `_sent_per_round` (None: no total logged, or no round)."""
    total = _sent_total(evs)
    return total / completed if total is not None and completed else None


# the driver event each fault option makes (report.json's `faults_fired` counts them)
FAULT_KINDS = {"kill_every": "kill", "freeze_every": "freeze", "leave_every": "leave", "late_joiners": "join",
               "kill_coordinator_at": "kill-coordinator", "crash_daemon_every": "daemon-crash"}


def faults_missed(report: dict) -> list[str]:
    """The fault options asked for whose fault never happened (faults wait for round 0 to be applied
    and stop before the last round, so a short run can end first)."""
    fired, asked = report.get("faults_fired") or {}, report.get("faults") or {}
    return [f"--{name.replace('_', '-')}" for name, kind in FAULT_KINDS.items()
            if asked.get(name) and kind in fired and not fired[kind]]


def _after(x: float | None) -> str:
    """"S s after" with one decimal, "never" where the run ended first."""
    return "never" if x is None else f"{x:.1f} s after"


def fault_summary(report: dict) -> str | None:
    """One line on the faults of a run and what they cost (None for a run without faults)."""
    kinds = [e["kind"] for e in report.get("events", [])]
    faults = {k: kinds.count(k) for k in ("kill", "freeze", "leave", "join", "kill-coordinator", "daemon-crash")
              if kinds.count(k)}
    if not faults:
        return None

    def mean_max(xs: list[float]) -> str:
        return f"{sum(xs) / len(xs):.1f} / {max(xs):.1f} s" if xs else "-"

    times = [t for t in report.get("round_times_s") or [] if t is not None] or [0.0]
    unmeasured = report.get("recovery_unmeasured") or {}
    unmeasured_text = " and ".join(f"{n} {text}" for n, text in (
        (unmeasured.get("recovery", 0), "with no round after"),
        (unmeasured.get("recovery_excluding", 0), "with no round without the peer after")) if n)
    plural = {"daemon-crash": "daemon crashes"}

    def counted(items: dict[str, int]) -> str:
        return ", ".join(f"{n} {k.replace('-', ' ') if n == 1 else plural.get(k, k + 's')}" for k, n in items.items())

    held = {k: n for k, n in (report.get("faults_held_back") or {}).items() if n}
    return (counted(faults)
            + (f" ({counted(held)} held back: no more than --min-peers peers up)" if held else "")
            + f"; recovery mean/max {mean_max(report['recovery_s'])}"
            + f" (until a round leaves the peer out: {mean_max(report['recovery_excluding_s'])})"
            + (f" (faults left out: {unmeasured_text})" if unmeasured_text else "")
            + f"; rejoin mean/max {mean_max(report['rejoin_s'])}"
            + (f"; after a daemon crash, counted again {mean_max([x for x in crashes if x is not None])}"
               + (f" ({crashes.count(None)} never)" if None in crashes else "")
               if (crashes := report.get("daemon_crash_rejoin_s")) else "")
            + (f" ({report['never_rejoined']} never rejoined)" if report.get("never_rejoined") else "")
            + "".join(f"; coordinator killed at {o['at_s']:.0f} s: next round {_after(o['next_round_s'])}, "
                      f"coordinator back in step {_after(o['back_in_step_s'])}"
                      for o in report.get("coordinator_outages") or [])
            + f"; longest round {max(times):.1f} s"
            + f"; lost contributions {report['lost_contributions']}"
            + (f" ({report['double_counted_contributions']} applied twice)"
               if report.get("double_counted_contributions") else "")
            + (f" ({report['presumed_lost_contributions']} presumed counted by a restart that could not check "
               "the commit)" if report.get("presumed_lost_contributions") else ""))
