"""Swarm commands of the `groundswell` CLI: keygen, launch, join, status (simulate: cli_simulate.py)."""

from __future__ import annotations

import contextlib
import signal
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.live import Live
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from .cli import _set_threads, _user_errors, app, console
from .cli_output import resumed_line, saved_before, setup_logging
from .config import ConfigError, check_device
from .join_consent import volunteer_corpus
from .launch_checks import (
    as_first_launched,
    checkpoints_not_gone,
    not_a_volunteer_dir,
    prepare_manifest,
    record_run,
    resumable,
    same_run_as_before,
)
from .round_view import in_aggregate, loss_text, of_round, round_line, round_table
from .state_files import checkpoints_newest_first, make_state_dir, write_atomically


def _identity(path: Optional[Path], state_dir: Optional[Path]):
    """The node's identity, held exclusively by this process with its state dir. The default one
    (STATE_DIR/identity.key) is created if missing; a path given with --identity must exist: a
    mistyped one would silently make this node someone else (a coordinator, a new run key)."""
    from groundswell.protocol.identity import Identity, IdentityError

    from .locks import hold_exclusively, hold_key_file, identity_lock_path

    if path is not None and not path.exists():
        raise IdentityError(f"no identity at {path}: create one with `groundswell keygen {path}`, or leave "
                            "--identity out to use the one in --state-dir")
    if path is not None and path.is_dir():
        raise IdentityError(f"--identity {path} is a folder, not an identity file (from `groundswell keygen`)")
    if path is not None:
        Identity.load(path)  # a bad key file is refused before the state dir is made (a review found one left behind)
    if state_dir is not None:  # first: the default identity lives in it
        make_state_dir(state_dir)
        hold_exclusively(state_dir / ".lock", "state dir", state_dir)
    path = path or ((state_dir or Path.home() / ".groundswell") / "identity.key")
    path.parent.mkdir(parents=True, exist_ok=True)
    ident = Identity.load_or_generate(path)
    # Two processes under one identity are one libp2p peer id at two addresses: the DHT and every
    # stream would reach either at random. Locked by peer id (a key copied to two paths is one
    # identity) in a per-user folder (the key's own folder may be read-only).
    hold_exclusively(identity_lock_path(ident.peer_id), "identity", path, "give this one its own --identity")
    hold_key_file(path)
    return ident, path


def _say(text: str) -> None:
    console.print(escape(text), highlight=False)


def _stop_on_signals(first: str = "stopping after this round"):
    from .stop_flag import StopFlag

    stop = StopFlag()
    stop.arm_for_signals()
    presses = {"n": 0}

    def handler(signum, frame):  # first press: stop cleanly (`first` says how); second: leave now
        presses["n"] += 1
        if presses["n"] > 1:
            raise KeyboardInterrupt
        stop.set_from_signal()  # first: the print below may fail (see there) or block on a full pipe
        again = "Ctrl+C again" if signum == signal.SIGINT else "SIGTERM or Ctrl+C again"
        try:
            console.print(f"[yellow]{first} ({again} to leave at once)[/]")
        except (RuntimeError, OSError):  # the main thread was inside a write to the same stream ("reentrant call")
            pass  # the stop is what matters; the interrupted write goes on

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    return stop


@app.command()
@_user_errors
def keygen(path: Path = typer.Argument(..., help="Where to write the identity (Ed25519, libp2p format)."),
           force: bool = typer.Option(False, "--force", help="Overwrite an existing file.")) -> None:
    """Write a new Ed25519 identity; prints its peer id."""
    from groundswell.protocol.identity import Identity

    if path.is_dir():
        raise IsADirectoryError(f"{path} is a folder: give the identity file's path, e.g. {path / 'identity.key'}")
    if not path.parent.is_dir():
        if path.parent.exists():
            raise NotADirectoryError(f"{path.parent} is not a folder: give the path of a file in a folder")
        raise FileNotFoundError(f"{path.parent} does not exist: create the folder first")
    ident = Identity.generate()
    try:
        ident.save(path, overwrite=force)
    except FileExistsError:
        raise FileExistsError(f"{path} exists; pass --force to overwrite it") from None
    except OSError as exc:  # often raised for the temp file next to it: name the file asked for
        raise OSError(f"cannot write {path}: {exc.strerror or exc} (in {path.parent})") from None
    print(ident.peer_id)


@app.command()
@_user_errors
def launch(
    manifest_path: Path = typer.Argument(..., help="The run manifest (TOML)."),
    listen: list[str] = typer.Option(["/ip4/0.0.0.0/tcp/0"], help="Multiaddr(s) to listen on."),
    announce: list[str] = typer.Option([], help="Multiaddr(s) to announce (public address behind a port forward)."),
    state_port: int = typer.Option(0, help="TCP port for direct (sealed) state downloads (0: any free port; "
                                   "-1: off, joiners get the state over libp2p). Forward it beside the libp2p "
                                   "port behind a port forward."),
    peer: list[str] = typer.Option([], help="Multiaddr(s) of live peers to reconnect to after a restart."),
    identity: Optional[Path] = typer.Option(None, help="Identity file (from `groundswell keygen`).",
                                            show_default="STATE_DIR/identity.key, made if missing"),
    state_dir: Path = typer.Option(Path("groundswell-run"), help="Checkpoints and logs; reuse it to resume."),
    quiet: bool = typer.Option(False, "--quiet", help="No live table and no line per round (for scripts: "
                               "STATE_DIR/events.jsonl has every round)."),
    verbose: bool = typer.Option(False, "--verbose", help="Log protocol events."),
    threads: int = typer.Option(0, help="torch threads (0 = default)."),
    checkpoint_every: int = typer.Option(0, help="Rounds between this coordinator's checkpoints.",
                                         show_default="the manifest's checkpoint.every_rounds"),
    device: str = typer.Option("cpu", help="cpu or cuda: where the coordinator applies rounds and evaluates "
                               "the held-out loss (every eval.every_rounds rounds)."),
) -> None:
    """Coordinate a run: bootstrap/relay peer, signed manifest, state for joiners, checkpoints."""
    from .bootstrap import check_maddr_flag, format_bootstrap
    from .coordinator_role import run_coordinator
    from .manifest import load_manifest_toml, sign_manifest
    from .network_restarts import release_memory, restarted_node, run_restarting
    from .participant import Participant
    from .swarm import NodeOptions

    setup_logging(verbose)
    _set_threads(threads)
    check_device(device)
    for flag, maddrs in (("--listen", listen), ("--announce", announce), ("--peer", peer)):
        check_maddr_flag(flag, maddrs, peer_id=flag == "--peer")  # before the disk: see `record_run`
    if checkpoint_every < 0:
        raise ConfigError(f"--checkpoint-every must be at least 1 (or 0: the manifest's), not {checkpoint_every}")
    if not -1 <= state_port <= 65535:
        raise ConfigError(f"--state-port must be -1 (off), 0 (any free port) or a port number, not {state_port}")
    manifest, corpus, workload = prepare_manifest(load_manifest_toml(manifest_path), manifest_path)
    manifest = as_first_launched(state_dir, manifest)
    if identity is None and (state_dir / "manifest.signed").exists() and not (state_dir / "identity.key").exists():
        # launched before with --identity elsewhere: a new key made here would only be refused
        # (it is not the run's), and left behind to be refused again next time
        raise ConfigError(f"{state_dir} holds a run launched with --identity elsewhere: resume it with the same "
                          "--identity, or start a new run (a new run.id and --state-dir)")
    not_a_volunteer_dir(state_dir)  # before its identity.key is read as the coordinator's
    ident, ident_path = _identity(identity, state_dir)
    signed = sign_manifest(manifest, ident).to_bytes()
    # public: it is the run's bootstrap and relay (volunteers dial it at the line it prints). Left
    # to a dial-back probe after a restart with --peer, a "private" answer (a firewall, a lying
    # peer) turned its DHT into a client and its daemon private while its joins still said it serves.
    opts = NodeOptions(host_maddrs=listen, announce_maddrs=announce, initial_peers=peer, role="coordinator",
                       reachability="public", trains=False, serves=True, direct_state=state_port >= 0, direct_port=max(state_port, 0))
    p = Participant(manifest, signed, ident, str(ident_path), opts, state_dir, device=device, corpus=corpus,
                    workload=workload)
    del workload  # its own now: a network restart's `release_memory` frees it before the next is built
    # a state dir of another run, or with no readable checkpoint left, is refused before we write to it
    resumed = p.preload_checkpoint()
    resumable(state_dir, resumed)
    same_run_as_before(state_dir, signed)
    checkpoints_not_gone(state_dir)  # (after the above: a dir of another run is told so first)
    if resumed is not None:
        console.print(f"resuming run {manifest.run.id} from its checkpoint at the start of round {resumed['round']} in "
                      f"{escape(str(state_dir))}", highlight=False)
    stop = _stop_on_signals("stopping: saving a checkpoint")
    rows: list = []
    node = p.node  # (its own name: a failure while a restart builds the next participant closes it too)
    try:  # from here on the node is closed whatever happens (an attach timeout, a full disk, Ctrl+C)
        p.start_network()
        record_run(state_dir, signed)
        boot = format_bootstrap(ident.peer_id, p.node.maddrs)
        write_atomically(state_dir / "bootstrap.txt", lambda f: f.write(f"{boot}\n".encode()))  # read by scripts
        console.print(f"[bold]run {manifest.run.id}[/] coordinated by {ident.peer_id}")
        console.print(f"volunteers join with:\n  groundswell join '{boot}'", highlight=False, soft_wrap=True)
        live = None  # a new one each time run() starts: one entered again erases the lines printed meanwhile

        def on_round(info):
            if live is None:  # a log file or a pipe: a live table would show nothing there until the end
                console.print(round_line(info), highlight=False, markup=False)
            elif info.status == "caught-up":  # no row: the rounds were the swarm's
                live.update(round_table(rows, f"{manifest.run.id}: caught up to round {info.round}: {info.reason}"))
            elif info.status != "applied":  # no row: the round runs again
                live.update(round_table(rows, f"{manifest.run.id}: round {info.round} again: {info.reason}"))
            else:
                rows.append(info)
                del rows[:-12]  # (the table shows the last 12: a long run's rows would pile up for good)
                live.update(round_table(rows, f"{manifest.run.id}: round {info.round + 1}"))

        def run() -> None:
            nonlocal live
            if not quiet and console.is_terminal:
                live = Live(round_table(rows, manifest.run.id), console=console, refresh_per_second=2)
            with live or contextlib.nullcontext():
                run_coordinator(p, stop=stop, on_round=(lambda info: None) if quiet else on_round,
                                checkpoint_every=checkpoint_every)

        def stopped(why: BaseException) -> None:
            kept = (f"its newest checkpoint, {escape(str(p.last_checkpoint))}," if not p.last_save_failed
                    and p.last_checkpoint is not None else f"what {escape(str(state_dir))} holds")
            console.print(f"[yellow]the network stopped[/] ({escape(str(why))}); the run goes on from {kept} "
                          "with a new network", highlight=False)
            node.close()

        def start(why: BaseException, wait: float) -> None:
            nonlocal p, boot, node
            if stop.event.wait(wait):
                return
            node = restarted_node(ident, str(ident_path), node, opts, say=_say)
            again = format_bootstrap(ident.peer_id, node.maddrs)
            if again != boot:  # (another process took our port meanwhile)
                boot = again
                write_atomically(state_dir / "bootstrap.txt", lambda f: f.write(f"{boot}\n".encode()))
                console.print(f"volunteers join with:\n  groundswell join '{boot}'", highlight=False, soft_wrap=True)
            p.events.write("network-restart", round=p.outer.round_id, reason=str(why)[:300], peer=ident.peer_id)
            p = None  # the old state goes before the new one is loaded (see `release_memory`)
            release_memory(device)
            p = Participant(manifest, signed, ident, str(ident_path), node.options, state_dir, device=device,
                            corpus=corpus, node=node)

        if not run_restarting(run, lambda: node.failure, stopped, start, stop):
            console.print(f"stopped while the network was down; the run's state is in {escape(str(state_dir))} "
                          "(launch again with this --state-dir to resume)", highlight=False)
            return
        if p.last_save_failed:  # the error was said in its own line, maybe far above
            console.print(f"[red]stopped; the final state could not be saved[/]: {saved_before(p)}", highlight=False)
        elif p.last_checkpoint is not None:
            console.print(f"stopped; the run's state is in {escape(str(p.last_checkpoint))} (launch again with "
                          "this --state-dir to resume)", highlight=False)
    finally:
        node.close()


@app.command()
@_user_errors
def join(
    bootstrap: str = typer.Argument(..., help="The line `groundswell launch` printed (gs1:...)."),
    identity: Optional[Path] = typer.Option(None, help="Identity file (from `groundswell keygen`).",
                                            show_default="STATE_DIR/identity.key, made if missing"),
    device: str = typer.Option("cpu", help="cpu or cuda."),
    state_dir: Path = typer.Option(Path("groundswell-peer"), help="Checkpoints and logs; reuse it to resume."),
    max_rounds: Optional[int] = typer.Option(None, help="Leave after this many applied rounds."),
    until_round: Optional[int] = typer.Option(None, help="Leave once the run has reached this round."),
    listen: list[str] = typer.Option(["/ip4/0.0.0.0/tcp/0"], help="Multiaddr(s) to listen on."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bar and no line per round (for scripts: STATE_DIR/events.jsonl "
                               "has every round)."),
    verbose: bool = typer.Option(False, "--verbose", help="Log protocol events."),
    threads: int = typer.Option(0, help="torch threads (0 = default)."),
    reachability: str = typer.Option("auto", help="auto (a bootstrap peer dials us back), public or private."),
    data: Optional[Path] = typer.Option(None, help="Our copy of the run's dataset (a folder of text files, or one "
                                        "with train.bin and val.bin): needed when the run trains on its own "
                                        "data rather than the Python standard library's sources."),
    allow_model_code: bool = typer.Option(False, "--allow-model-code", help="Run a model the manifest names as 'module:callable' (it "
                                          "imports and runs that module, installed on this machine)."),
    attack: str = typer.Option("", hidden=True, help="Simulations only: tamper with contributions (peer/byzantine.py)."),
    data_seed: Optional[int] = typer.Option(None, hidden=True, min=0, max=2**63 - 1,
                                            help="Simulations only: the seed of this volunteer's data order "
                                                 "(default: from the run's seed and our peer id)."),
) -> None:
    """Join a run as a volunteer: verify the manifest, download the state, train and exchange."""
    from .bootstrap import check_maddr_flag, parse_bootstrap
    from .dht_rejoin import load_known_peers
    from .join_network import fetch_manifest, manifest_digest, say_reachability
    from .network_restarts import release_memory, restarted_node, run_restarting
    from .participant import Participant
    from .participant_checkpoints import KNOWN_PEERS_FILE
    from .roles import run_volunteer, write_defence_counts
    from .swarm import NodeOptions, SwarmNode
    from .volunteer_dir import (
        bind_volunteer_dir,
        bound_launch,
        check_volunteer_dir,
        check_volunteer_identity,
        check_volunteer_peer,
        not_a_coordinator_dir,
    )

    setup_logging(verbose)
    _set_threads(threads)
    check_device(device)
    if reachability not in ("auto", "public", "private"):
        raise ConfigError(f"--reachability must be auto, public or private, not {reachability!r}")
    if max_rounds is not None and max_rounds < 1:  # 0 or less would leave at once, as if it had trained
        raise ConfigError(f"--max-rounds must be at least 1, not {max_rounds}")
    if until_round is not None and until_round < 1:  # rounds count from 0: the run is always past 0
        raise ConfigError(f"--until-round must be at least 1 (the run starts at round 0), not {until_round}")
    check_maddr_flag("--listen", listen)
    boot = parse_bootstrap(bootstrap)
    if state_dir.is_dir():  # (before the identity is made there, and before the network starts)
        not_a_coordinator_dir(state_dir)
        check_volunteer_identity(state_dir, identity is not None)
    ident, ident_path = _identity(identity, state_dir)
    if ident.peer_id == boot.coordinator_id:
        raise ConfigError(f"{ident_path} is the coordinator's identity: a volunteer needs its own --identity")
    check_volunteer_peer(state_dir, ident.peer_id)
    opts = NodeOptions(host_maddrs=listen, initial_peers=boot.maddrs, coordinator=boot.coordinator_id,
                       role="volunteer", trains=True, serves=True, reachability=reachability)
    node = SwarmNode(ident, str(ident_path), opts)
    bound = bound_launch(state_dir, boot.coordinator_id) if state_dir.is_dir() else None
    if bound is not None:  # the run's peers this volunteer knew: entered through if every bootstrap peer is down
        node.rejoiner.restore(load_known_peers(state_dir / KNOWN_PEERS_FILE))
    node.start()
    try:
        # others may bootstrap from us (a simulation reads it while we run: never half-written)
        write_atomically(state_dir / "address.txt", lambda f: f.write(("\n".join(node.maddrs) + "\n").encode()))
        peers = [m.rsplit("/p2p/", 1)[1] for m in boot.maddrs]
        signed, manifest = fetch_manifest(node, boot.maddrs, boot.coordinator_id, launch=bound)
        manifest.check_may_train(ident.peer_id)  # before any download: its contributions would be refused
        launch = manifest_digest(signed)
        unbound = check_volunteer_dir(state_dir, ident.peer_id, boot.coordinator_id, manifest.run.id,
                                      launch)  # before it is read
        corpus = volunteer_corpus(manifest, data, allow_model_code)
        console.print(f"joined run [bold]{manifest.run.id}[/] as {ident.peer_id} (manifest verified)")
        say_reachability(node, peers)
        p = Participant(manifest, signed, ident, str(ident_path), opts, state_dir, device=device, node=node,
                        corpus=corpus)
        p.data_seed = data_seed
        if unbound:
            p.preload_checkpoint()  # another run's checkpoint is refused before the folder is bound to this run
            bind_volunteer_dir(state_dir, ident.peer_id, boot.coordinator_id, manifest.run.id, launch)
        stop = _stop_on_signals()
        h = manifest.outer.inner_steps
        tokens_per_step = manifest.data.batch_size * p.workload.block_size
        bar = Progress(TextColumn("[bold]round {task.fields[round]}"), BarColumn(), MofNCompleteColumn(),
                       TextColumn("loss {task.fields[loss]:.3f}  {task.fields[tps]:,.0f} tok/s"),
                       console=console, disable=quiet or not sys.stderr.isatty())
        task = bar.add_task("inner", total=h, round=p.outer.round_id, loss=float("nan"), tps=0.0)
        # Steps and time since the round's first step: the first round's clock must not count the
        # state download, nor the bar the extra steps trained while a round was still out.
        clock: dict = {"t": None, "n": 0}

        def on_step(step: int, loss: float) -> None:
            now = time.perf_counter()
            if clock["t"] is None:
                clock["t"] = now  # (this step's own time is not known: the rate counts from the next)
            clock["n"] += 1
            rate = (clock["n"] - 1) * tokens_per_step / max(now - clock["t"], 1e-9)
            bar.update(task, completed=min(clock["n"], h), round=p.outer.round_id, loss=loss, tps=rate)

        applied = {"n": 0}  # across network restarts, for --max-rounds

        def on_round(info):
            applied["n"] += info.status == "applied"
            clock.update(t=None, n=0)
            bar.update(task, completed=0, round=p.outer.round_id)
            if not quiet:
                console.print(f"round {info.round}: {info.status}"
                              + (f", {in_aggregate(info)} of {info.contributors}, "
                                 f"eval {loss_text(info.eval_loss)}{of_round(info)}, {info.bytes_sent / 1e6:.2f} MB, {info.round_s:.1f} s, "
                                 f"{info.tokens_per_s:,.0f} tok/s" if info.status == "applied" else
                                 # ("round 2: retry (attempt 8: ...)", not "(round 2 attempt 8: ...)")
                                 f" ({info.reason.removeprefix(f'round {info.round} ')})" if info.reason else ""),
                              highlight=False, markup=False)  # (a reason may quote a peer's words)

        tamper = None
        if attack:
            from .byzantine import Attack

            tamper = Attack(attack, p.outer.codec, seed=manifest.run.seed)
            console.print(f"[bold red]byzantine peer[/]: attack {attack!r} (simulation)")
        def on_resume(what: dict) -> None:
            console.print(resumed_line(state_dir, what), highlight=False)

        def run() -> None:
            left = None if max_rounds is None else max_rounds - applied["n"]
            if left is None or left > 0:
                with bar:
                    run_volunteer(p, peers, max_rounds=left, until_round=until_round, stop=stop,
                                  on_round=on_round, on_step=on_step, attack=tamper, on_resume=on_resume)

        def stopped(why: BaseException) -> None:
            console.print(f"[yellow]the network stopped[/] ({escape(str(why))}); our work is in "
                          f"{escape(str(state_dir))}: starting a new network", highlight=False)
            write_defence_counts(p)  # what the old node refused and sent, for the run's report
            node.close()

        def start(why: BaseException, wait: float) -> None:
            nonlocal node, p
            if stop.event.wait(wait):
                return
            node = restarted_node(ident, str(ident_path), node, opts, say=_say)
            write_atomically(state_dir / "address.txt", lambda f: f.write(("\n".join(node.maddrs) + "\n").encode()))
            say_reachability(node, peers)
            p.events.write("network-restart", round=p.outer.round_id, reason=str(why)[:300], peer=ident.peer_id)
            p = None  # the old model and optimizer go before the new ones are built (see `release_memory`)
            release_memory(device)
            p = Participant(manifest, signed, ident, str(ident_path), opts, state_dir, device=device,
                            node=node, corpus=corpus)
            p.data_seed = data_seed

        try:
            if not run_restarting(run, lambda: node.failure, stopped, start, stop):
                kept = checkpoints_newest_first(state_dir)
                console.print(f"stopped while the network was down: {escape(str(state_dir))} keeps "
                              f"{escape(kept[0].name) if kept else 'its files'} and the work not yet sent; the same "
                              "command resumes from there", highlight=False)
                return
        except KeyboardInterrupt:  # pressed twice: what is on disk, and that it is not lost
            newest = checkpoints_newest_first(state_dir)
            kept = f"its newest checkpoint ({escape(newest[0].name)})" if newest else "its files"
            console.print(f"[yellow]left at once[/]: {escape(str(state_dir))} keeps {kept} and the work not yet "
                          "sent; the same command resumes from there", highlight=False)
            raise typer.Exit(130) from None
        if p.last_save_failed:  # "cleanly" and an older checkpoint's name would hide the lost rounds
            console.print(f"[red]left the run, but the final state could not be saved[/]: {saved_before(p)}",
                          highlight=False)
        else:
            saved = f"; checkpoint: {escape(str(p.last_checkpoint))}" if p.last_checkpoint is not None else ""
            console.print(f"left the run cleanly{saved}", highlight=False)
    finally:
        node.close()
