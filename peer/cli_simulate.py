"""`groundswell simulate`: a coordinator and N volunteer processes on 127.0.0.1, with churn."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .cli import _user_errors, app, console
from .config import ConfigError


@app.command()
@_user_errors
def simulate(
    peers: int = typer.Option(4, help="Volunteer processes."),
    rounds: int = typer.Option(10, help="Rounds the run goes to: volunteers leave once it reaches round R (late joiners and restarted peers apply fewer)."),
    preset: str = typer.Option("tiny", help="Model preset or module:callable."),
    algorithm: str = typer.Option("sparseloco", help="diloco or sparseloco."),
    codec: str = typer.Option("", help="Outer codec: fp32, fp16, bf16, int8, sparseloco.", show_default="the algorithm's"),
    inner_steps: int = typer.Option(20, "--inner-steps", "-H", help="Inner steps per round."),
    batch_size: int = typer.Option(8, help="Inner batch size."),
    deadline: float = typer.Option(
        30.0, help="Round deadline in seconds: a round is decided by it (contributions are due 2 slacks earlier)."),
    min_peers: Optional[int] = typer.Option(None, help="Contributions a round needs.", show_default="2, or 1 with --peers 1"),
    outer_lr: float = typer.Option(0.0, help="Outer learning rate.", show_default="the algorithm's"),
    topk: Optional[int] = typer.Option(None, help="SparseLoCo: values kept per 4096-chunk.", show_default="64"),
    error_decay: Optional[float] = typer.Option(None, help="SparseLoCo: error-feedback decay in [0, 1].",
                                                show_default="0.95"),
    overlap: int = typer.Option(0, help="1: exchange each round while the next H steps train (delayed outer step)."),
    warmup: Optional[int] = typer.Option(None, help="Inner learning-rate warmup steps.", show_default="min(50, 2 H)"),
    seed: int = typer.Option(0, help="Run seed (also seeds every fault's victim)."),
    out: Path = typer.Option(Path("sim-out"), help="Output folder (report.json, loss.png, logs)."),
    kill_every: float = typer.Option(0.0, help="SIGKILL a random live peer every S seconds."),
    restart_after: Optional[float] = typer.Option(None, help="Restart a killed peer (same identity and state) after "
                                                  "S s.", show_default="0: killed peers stay dead"),
    freeze_every: float = typer.Option(0.0, help="SIGSTOP a random peer every S seconds..."),
    freeze_for: Optional[float] = typer.Option(None, help="...and SIGCONT it S seconds later.", show_default="10.0"),
    late_joiners: int = typer.Option(0, help="Start K extra peers after round 2."),
    leave_every: float = typer.Option(0.0, help="A random peer leaves cleanly (SIGINT) every S seconds."),
    kill_coordinator_at: float = typer.Option(0.0, help="SIGKILL the coordinator at S s (or once round 0 is "
                                              "applied, if later; never in the last round); restart it from its state."),
    crash_daemon_every: float = typer.Option(0.0, help="SIGKILL a random peer's libp2p daemon (the coordinator's too) "
                                             "every S seconds; the peer starts a new one and goes on."),
    checkpoint_every: int = typer.Option(5, help="Rounds between checkpoints."),
    byzantine: int = typer.Option(0, help="K of the volunteers misbehave (see --attack)."),
    attack: Optional[str] = typer.Option(None, help="What byzantine peers do: scale, random, signflip, nan or stale.",
                                         show_default="scale"),
    defences: bool = typer.Option(True, "--defences/--no-defences",
                                  help="Robust aggregation (norm clipping) on or off; input validation stays on."),
    scoring: bool = typer.Option(False, "--scoring", help="Leaders score each contribution on a probe batch, drop harmful ones."),
    timeout: float = typer.Option(1800.0, help="Stop the run after S seconds, finished or not (the summary says so)."),
    cuda_peers: int = typer.Option(0, help="The first K volunteers train and encode on the GPU (join --device cuda)."),
) -> None:
    """A coordinator and N volunteers on 127.0.0.1 (real libp2p), R rounds; writes OUT/report.json."""
    from .round_view import count_of
    from .sim_report import fault_summary, faults_missed
    from .simulate import SimulateOptions, run_simulation

    if scoring and not defences:
        raise ConfigError("--scoring is a defence: it cannot go with --no-defences")
    slack = SimulateOptions.slack_s
    if not deadline > 2 * slack:  # said in the options' words (the manifest's would name round.slack_s)
        raise ConfigError(f"--deadline must exceed {2 * slack:g} s (contributions are due two {slack:g} s slacks "
                          f"before it), not {deadline:g}")
    if overlap not in (0, 1):
        raise ConfigError(f"--overlap must be 0 or 1, not {overlap}")
    if min_peers is None:
        min_peers = min(2, peers)
    if min_peers > peers:
        raise ConfigError(f"--min-peers {min_peers} is more than --peers {peers}: no round could ever commit")
    # None: not given; the options' defaults fill in, and the options see what was given (even
    # its default value) to refuse what could never take effect
    optional = {"topk": topk, "error_decay": error_decay, "restart_after": restart_after, "freeze_for": freeze_for,
                "attack": attack}
    given = {name: value for name, value in optional.items() if value is not None}
    opts = SimulateOptions(peers=peers, rounds=rounds, preset=preset, algorithm=algorithm, codec=codec,
                           inner_steps=inner_steps, batch_size=batch_size, deadline_s=deadline,
                           min_peers=min_peers, seed=seed, outer_lr=outer_lr, overlap=overlap, warmup_steps=warmup,
                           kill_every=kill_every, freeze_every=freeze_every, late_joiners=late_joiners,
                           leave_every=leave_every, kill_coordinator_at=kill_coordinator_at,
                           crash_daemon_every=crash_daemon_every,
                           checkpoint_every=checkpoint_every, byzantine=byzantine, defences=defences,
                           scoring=scoring, timeout_s=timeout, cuda_peers=cuda_peers, **given, given=set(given))
    report = run_simulation(opts, out, progress=lambda m: console.print(m, highlight=False))
    console.print(
        f"[bold]{report['rounds_completed']}/{report['rounds_target']} rounds[/], {count_of(report['peers'], 'peer')}, "
        f"{report['codec']}: {loss_summary(report)}; "
        f"{kilobytes(report['bytes_sent_per_peer_per_round'])} kB/peer/round{state_share(report)} "
        f"(dense ring: {report['dense_fp32_ring_bytes_per_peer_per_round'] / 1e3:,.0f} kB); "
        f"hashes agree: {report['param_hash_agreement']}{hash_checks(report)}; {report['wall_s']:.0f} s; "
        f"report: {out / 'report.json'}"
        if report["rounds_completed"] else f"no round completed; see the logs in {out}",
        highlight=False,
    )
    if report.get("timed_out"):  # whatever else the run reached, it did not end by itself
        console.print(f"[bold yellow]stopped by the timeout:[/] the run was still going after {timeout:g} s "
                      "(--timeout)", highlight=False)
    # The checks first: a run that failed one fails (exit 1) though Ctrl+C stopped it afterwards
    # (it exited 130 and hid divergent rounds and crashed peers, found by a review). Fewer rounds
    # than asked for is no failure of a run Ctrl+C cut short, unless the timeout had stopped it first.
    cut_short = report.get("interrupted") and not report.get("timed_out")
    failed = [what for what, bad in (
        (f"only {report['rounds_completed']} of {report['rounds_target']} rounds completed",
         report["rounds_completed"] < report["rounds_target"] and not cut_short),
        (f"parameter hashes differ in rounds {report['divergent_rounds']}", bool(report["divergent_rounds"])),
        (f"no process reported a parameter hash in rounds {report.get('hashless_rounds')}",
         bool(report.get("hashless_rounds"))),
        ("no parameter hash logged by " + ", ".join(f"{u['peer']} in round {u['round']}"
                                                    for u in report.get("unhashed") or []),
         bool(report.get("unhashed"))),
        (f"{', '.join(report['crashed'])} exited with an error", bool(report["crashed"]))) if bad]
    if report.get("interrupted"):  # Ctrl+C: the report holds the run until then
        console.print(f"[bold yellow]interrupted[/] after {report['wall_s']:.0f} s: {out / 'report.json'} covers "
                      "the run until then", highlight=False)
    else:
        faults = fault_summary(report)
        if faults:
            console.print(faults, highlight=False)
        if missed := faults_missed(report):  # the run is not what was asked for: said, though not a failure
            console.print(f"[bold yellow]never happened:[/] {', '.join(missed)} (faults start once round 0 is applied, "
                          "late joiners once round 2 is, and none comes in the last round or without a peer to "
                          "take: the run ended, or no peer could be taken, first)", highlight=False)
    if failed:  # scripts and CI read the exit status
        console.print(f"[bold red]simulation failed:[/] {'; '.join(failed)}", highlight=False)
        raise typer.Exit(1)
    if report.get("interrupted"):
        raise typer.Exit(130)


def hash_checks(report: dict) -> str:
    """" (compared in N rounds)": the rounds whose hash two or more processes reported, those no
    two did, those none did and the processes that finished a round without one ("": not in the report)."""
    n = report.get("hash_checked_rounds")
    if n is None:
        return ""
    unchecked = report.get("unchecked_rounds") or []
    hashless, unhashed = report.get("hashless_rounds") or [], report.get("unhashed") or []
    # why the agreement is false though no two hashes differ: rounds nobody hashed, peers that did not
    return (f" (compared in {n} round{'s' if n != 1 else ''}"
            + (f"; not in round{'s' if len(unchecked) != 1 else ''} {', '.join(map(str, unchecked))}, which fewer "
               "than two processes reported" if unchecked else "")
            + (f"; no process reported one in round{'s' if len(hashless) != 1 else ''} "
               f"{', '.join(map(str, hashless))}" if hashless else "")
            + (f"; {len(unhashed)} finished a round without one" if unhashed else "") + ")")


def kilobytes(n: float | None) -> str:
    """Bytes as kB with one decimal, "-" where nothing was measured."""
    return "-" if n is None else f"{n / 1e3:,.1f}"


def state_share(report: dict) -> str:
    """What of the bytes per round were states served to joiners, where any were (churn)."""
    state = report.get("state_bytes_sent_per_peer_per_round")
    return f" (of which {state / 1e3:,.1f} kB states served to joiners)" if state else ""


def loss_summary(report: dict) -> str:
    """The held-out loss from the first to the last round evaluated, naming that round when it is
    not the last completed, and saying whether the loss diverged (was NaN or infinite)."""
    by_round = report["eval_loss_by_round"]
    losses = [v for v in by_round if v is not None]  # rounds the coordinator evaluated, finite losses
    last = report.get("final_eval_round", max((r for r, v in enumerate(by_round) if v is not None), default=None))
    bad = report.get("eval_nonfinite_rounds") or []
    diverged = (f"diverged (not finite in {len(bad)} round{'s' if len(bad) > 1 else ''} from round {bad[0]})"
                if bad else "")
    if not losses:
        return f"held-out loss {diverged}" if bad else "no held-out loss evaluated"
    text = f"held-out loss {losses[0]:.3f}" + (f" -> {losses[-1]:.3f}" if len(losses) > 1 else "")
    if last is not None and last < report["rounds_completed"] - 1:
        text += f" at round {last} (the last completed: {report['rounds_completed'] - 1})"
    return f"{text}, {diverged}" if bad else text
