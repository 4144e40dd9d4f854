"""A user's mistake or an unreachable run is one `error:` line and exit code 2, never a
traceback; Ctrl+C before a command's own handler is one line and exit code 130."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from groundswell.peer.cli import app
from groundswell.peer.reachability import busy_listen_address
from groundswell.protocol.identity import Identity
from typer.testing import CliRunner

pytestmark = pytest.mark.timeout(120)


def _unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # closed again: nothing listens there


def _bootstrap(port: int) -> str:
    pid = Identity.generate().peer_id
    return f"gs1:{pid}@/ip4/127.0.0.1/tcp/{port}/p2p/{pid}"


def _one_error_line(res, exit_code: int, words: str) -> None:
    assert res.exit_code == exit_code, res.output
    assert "Traceback" not in res.output and words in " ".join(res.output.split()), res.output


@pytest.mark.parametrize("command", ["join", "status"])
def test_a_malformed_bootstrap_line_is_one_error_line(tmp_path, command):
    extra = ["--state-dir", str(tmp_path)] if command == "join" else []
    res = CliRunner().invoke(app, [command, "not-a-bootstrap-line", *extra])
    _one_error_line(res, 2, "error: a bootstrap string looks like")


def test_bad_options_are_one_error_line(tmp_path):
    line = _bootstrap(_unused_port())
    res = CliRunner().invoke(app, ["join", line, "--reachability", "sometimes", "--state-dir", str(tmp_path)])
    _one_error_line(res, 2, "--reachability must be auto, public or private")
    key = tmp_path / "id.key"
    assert CliRunner().invoke(app, ["keygen", str(key)]).exit_code == 0
    _one_error_line(CliRunner().invoke(app, ["keygen", str(key)]), 2, "exists; pass --force to overwrite it")
    _one_error_line(CliRunner().invoke(app, ["keygen", str(tmp_path), "--force"]), 2, f"{tmp_path} is a folder")
    _one_error_line(CliRunner().invoke(app, ["keygen", str(tmp_path / "no" / "id.key")]), 2,
                    f"{tmp_path / 'no'} does not exist")


def test_a_bad_coordinator_checkpoint_cadence_is_one_error_line_and_writes_nothing(tmp_path):
    manifest = Path(__file__).resolve().parents[1] / "scripts" / "example_run.toml"
    res = CliRunner().invoke(app, ["launch", str(manifest), "--checkpoint-every", "-1", "--state-dir",
                                   str(tmp_path / "run")])
    _one_error_line(res, 2, "--checkpoint-every must be at least 1")
    assert not (tmp_path / "run").exists()


def test_an_unreachable_run_is_one_error_line(tmp_path):
    # A real process, to see all a user would: no log line, no asyncio warning about the daemon
    # that failed to connect (reaped after its event loop closed, before reap_daemons).
    res = subprocess.run([sys.executable, "-m", "groundswell.peer", "join", _bootstrap(_unused_port()),
                          "--state-dir", str(tmp_path), "--listen", "/ip4/127.0.0.1/tcp/0"],
                         capture_output=True, text=True, timeout=90)
    words = " ".join((res.stdout + res.stderr).split())
    assert res.returncode == 2, words
    assert words.startswith("error: none of the bootstrap peers answered") and words.count("error") == 1, words
    assert words.endswith("is the run up, and is the address right?"), words


def test_ctrl_c_during_start_up_is_one_line(tmp_path, monkeypatch):
    from groundswell.peer import swarm

    def interrupted(self, timeout_s: float = 60.0) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(swarm.SwarmNode, "start", interrupted)
    res = CliRunner().invoke(app, ["join", _bootstrap(_unused_port()), "--state-dir", str(tmp_path)])
    _one_error_line(res, 130, "interrupted")


@pytest.mark.parametrize("args, words", [
    (["--peers", "0"], "--peers must be at least 1"),
    (["--rounds", "0"], "--rounds must be at least 1"),
    (["--peers", "2", "--byzantine", "3"], "--byzantine must be between 0 and --peers (2)"),
    (["--attack", "nope"], "--attack must be one of"),
    (["--scoring", "--no-defences"], "--scoring is a defence: it cannot go with --no-defences"),
    (["--peers", "3", "--min-peers", "4"], "--min-peers 4 is more than --peers 3"),
    (["--preset", "nosuch"], "unknown workload 'nosuch'"),
    (["--preset", "no_such_module:make"], "cannot import module 'no_such_module'"),
    (["--preset", 'x"y'], "unknown workload 'x\"y'"),  # quoted into the manifest, not pasted
    (["--preset", "x\U0001f600"], "unknown workload"),  # beyond the BMP: JSON's escapes are not TOML's
    (["--algorithm", "data-parallel"], "'data-parallel' cannot run in a swarm"),
    (["--deadline", "8"], "--deadline must exceed 10 s"),
    (["--overlap", "2"], "--overlap must be 0 or 1, not 2"),
    # a negative period used to kill (or freeze) a peer on every pass of the driver's loop
    (["--kill-every", "-5"], "--kill-every must be a finite number of seconds >= 0, got -5.0"),
    (["--freeze-every", "10", "--freeze-for", "-1"], "--freeze-for must be a finite number of seconds >= 0"),
    (["--restart-after", "nan"], "--restart-after must be a finite number of seconds >= 0"),
    (["--late-joiners", "-1"], "--late-joiners must be >= 0"),
    # the flags named, not the manifest keys they become
    (["--peers", "3", "--min-peers", "0"], "error: --min-peers must be >= 1, got 0"),
    (["--codec", "foo"], "error: --codec must be one of"),
    (["--algorithm", "diloco", "--codec", "sparseloco"], "error: --codec 'sparseloco' needs --algorithm 'sparseloco'"),
    (["--error-decay", "2"], "error: --error-decay must be in [0, 1], got 2.0"),
])
def test_bad_simulate_options_are_one_error_line_before_any_process_starts(tmp_path, args, words):
    res = CliRunner().invoke(app, ["simulate", *args, "--out", str(tmp_path / "sim")])
    _one_error_line(res, 2, words)
    assert not (tmp_path / "sim").exists()


def test_a_busy_listen_port_is_one_error_line_not_a_second_listener(tmp_path):
    # go-libp2p binds with SO_REUSEPORT: a second daemon on a coordinator's port would start and
    # take part of its connections. Hold the port the way p2pd does and launch on it.
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        res = subprocess.run([sys.executable, "-m", "groundswell.peer", "launch", "scripts/example_run.toml",
                              "--state-dir", str(tmp_path / "c"), "--listen", f"/ip4/127.0.0.1/tcp/{port}"],
                             capture_output=True, text=True, timeout=90,
                             cwd=Path(__file__).resolve().parents[1])
    words = " ".join((res.stdout + res.stderr).split())
    assert res.returncode == 2, words
    assert words.startswith(f"error: TCP port {port} on 127.0.0.1 is already in use"), words
    assert words.count("error") == 1 and "Traceback" not in words, words


def test_a_busy_state_port_asked_for_by_number_is_one_error_line(tmp_path):
    # A coordinator behind a port forward names its state port: silently serving without it would
    # leave joiners on the slow path with nothing but a log line to say why.
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        res = subprocess.run([sys.executable, "-m", "groundswell.peer", "launch", "scripts/example_run.toml",
                              "--state-dir", str(tmp_path / "c"), "--listen", "/ip4/127.0.0.1/tcp/0",
                              "--state-port", str(port), "--quiet"],
                             capture_output=True, text=True, timeout=90, check=False,
                             cwd=Path(__file__).resolve().parents[1])
    words = " ".join((res.stdout + res.stderr).split())
    assert res.returncode != 0, words
    assert f"error: TCP port {port} on 127.0.0.1 for direct state downloads (--state-port) cannot be used" in words, words
    assert words.count("error:") == 1 and "Traceback" not in words, words


def test_busy_listen_address_names_the_problem_and_skips_what_it_cannot_judge():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert "already in use" in busy_listen_address([f"/ip4/127.0.0.1/tcp/{port}"])
        assert "already in use" in busy_listen_address([f"/ip4/0.0.0.0/tcp/{port}"])  # the wildcard overlaps
    assert busy_listen_address([f"/ip4/127.0.0.1/tcp/{port}"]) is None  # free again
    assert busy_listen_address(["/ip4/127.0.0.1/tcp/0", "/ip4/127.0.0.1/udp/5/quic", "/dns4/x/tcp/5"]) is None
    assert "not an address of this machine" in busy_listen_address(["/ip4/192.0.2.1/tcp/4001"])


def test_a_lost_daemon_connection_leaves_no_asyncio_traceback_unless_verbose(caplog):
    import logging

    from groundswell.peer.cli_output import setup_logging as _logging

    log = logging.getLogger("asyncio")
    saved = (log.level, list(log.filters))
    try:
        _logging(verbose=False)
        for exc in (ConnectionResetError("Connection lost"), ValueError("a real bug")):
            try:
                raise exc
            except Exception as caught:
                log.error("Task exception was never retrieved", exc_info=(type(caught), caught, caught.__traceback__))
        shown = [str(r.exc_info[1]) for r in caplog.records if r.name == "asyncio"]
        assert shown == ["a real bug"], shown
    finally:
        log.setLevel(saved[0])
        log.filters[:] = saved[1]


def test_a_state_dir_or_identity_in_use_by_another_process_is_one_error_line(tmp_path):
    # The first holder is another process (a lock taken twice by one process is held once).
    import textwrap

    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from groundswell.peer.locks import hold_exclusively
        hold_exclusively(Path({str(tmp_path / 'a')!r}) / ".lock", "state dir", Path("a"))
        from groundswell.peer.locks import identity_lock_path
        from groundswell.protocol.identity import Identity
        ident = Identity.load_or_generate(Path({str(tmp_path / 'id.key')!r}))
        hold_exclusively(identity_lock_path(ident.peer_id), "identity", Path("id.key"))
        print("held", flush=True)
        time.sleep(60)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        (tmp_path / "a").mkdir()
        assert holder.stdout.readline().strip() == "held"
        line = _bootstrap(_unused_port())
        res = CliRunner().invoke(app, ["join", line, "--state-dir", str(tmp_path / "a")])
        _one_error_line(res, 2, f"is in use by another groundswell process (pid {holder.pid}); stop it, or give "
                                "this one its own --state-dir")
        res = CliRunner().invoke(app, ["join", line, "--state-dir", str(tmp_path / "b"),
                                       "--identity", str(tmp_path / "id.key")])
        _one_error_line(res, 2, "the identity")
        _one_error_line(res, 2, "its own --identity")
    finally:
        holder.kill()
        holder.wait()
    # the holder is gone (killed, not cleaned up): its lock went with it
    res = CliRunner().invoke(app, ["join", line, "--state-dir", str(tmp_path / "a"), "--listen", "/ip4/127.0.0.1/tcp/0"])
    _one_error_line(res, 2, "error: none of the bootstrap peers answered")


def test_a_process_that_did_not_start_is_named_with_its_first_error_line(tmp_path):
    from groundswell.peer.simulate import _first_error

    log = tmp_path / "coordinator.log"
    log.write_text("2026-12-01 10:00:00 hivemind INFO noise\nerror: TCP port 5 on 127.0.0.1 is already in use\n"
                   "(another groundswell peer or coordinator on this machine?)\n\nerror: a later one\n")
    assert _first_error(log) == (": TCP port 5 on 127.0.0.1 is already in use (another groundswell peer or "
                                 "coordinator on this machine?)")
    log.write_text("no error here\n")
    assert _first_error(log) == "" and _first_error(tmp_path / "missing.log") == ""


def test_a_clock_off_by_more_than_the_dht_allows_is_named_with_its_skew():
    from groundswell.peer.net_errors import clock_skew as _clock_skew

    refusal = "local time must be within 3 seconds  of others(local: 1796158009.75187, peer: 1796157949.75283)"
    assert abs(_clock_skew(refusal) - 59.99904) < 1e-6
    assert _clock_skew("failed to connect to bootstrap peers") is None
    # 3.3 s said so (it read "3 s ahead ... allows 3 s"), and a volunteer whose clock is right
    # learns that the coordinator's is off (a review's coordinator at +4 s refused every volunteer)
    from groundswell.peer.net_errors import explain_start_failure

    refusal = "local time must be within 3 seconds  of others(local: 1796158009.25, peer: 1796158012.55)"
    words = " ".join(str(explain_start_failure(RuntimeError(refusal), ["/ip4/192.0.2.1/tcp/1"])).split())
    assert "clock is 3.3 s behind the bootstrap peer's" in words and "tell the run's coordinator" in words


def test_bootstrap_peers_whose_dht_does_not_answer_in_time_are_named_so():
    # seen in a churn run: the restarted peer's bootstrap peers were up but too busy to answer
    # the DHT's 3 s ping, and the error only quoted hivemind ("set ensure_bootstrap_success=False")
    from groundswell.peer.net_errors import explain_start_failure

    err = RuntimeError("DHTNode bootstrap failed: none of the initial_peers responded to a ping. "
                       "(set ensure_bootstrap_success=False to ignore)")
    words = str(explain_start_failure(err, ["/ip4/192.0.2.1/tcp/1/p2p/QmX"]))
    assert "did not answer within 3 s" in words and "start again" in words and "ensure_" not in words


def test_a_node_the_bootstrap_peer_cannot_dial_back_is_told_a_fix_its_command_has():
    # A coordinator restarted with --peer behind a closed port was told "--reachability private",
    # a flag `launch` does not have.
    from groundswell.peer.net_errors import explain_start_failure

    err = RuntimeError("Peer X can't access this node. Probably, libp2p has failed to bypass the firewall")
    assert "--reachability private" in str(explain_start_failure(err, []))
    coordinator = str(explain_start_failure(err, [], role="coordinator"))
    assert "--reachability" not in coordinator and "--announce" in coordinator


def test_launch_on_a_state_dir_of_another_run_refuses_before_writing_anything(tmp_path, corpus):
    from groundswell.peer.manifest import manifest_from_mapping, sign_manifest
    from groundswell.peer.participant import Participant, genesis_decision
    from groundswell.peer.run_state import GlobalState
    from groundswell.peer.swarm import NodeOptions

    state = tmp_path / "run-1"
    state.mkdir()
    manifest = manifest_from_mapping({"run": {"id": "first-run", "open": True}, "model": {"spec": "tiny"}})
    ident = Identity.load_or_generate(state / "identity.key")
    p = Participant(manifest, sign_manifest(manifest, ident).to_bytes(), ident, str(state / "identity.key"),
                    NodeOptions(), state, corpus=corpus)
    p._snapshot = GlobalState(0, {"global_params": p.outer.global_params.clone()}, genesis_decision(ident, "first-run"))
    assert p.save_checkpoint() is not None
    (state / "bootstrap.txt").write_text("gs1:the-first-run's-line\n")
    before = {f.name: f.read_bytes() for f in state.iterdir()}
    other = (Path(__file__).resolve().parents[1] / "scripts" / "example_run.toml").read_text()
    (tmp_path / "other.toml").write_text(other)  # run id "example-tiny"
    res = CliRunner().invoke(app, ["launch", str(tmp_path / "other.toml"), "--state-dir", str(state),
                                   "--listen", "/ip4/127.0.0.1/tcp/0", "--quiet"])
    _one_error_line(res, 2, "holds a checkpoint (checkpoint-00000000.pt) of another run")
    after = {f.name: f.read_bytes() for f in state.iterdir() if f.name != ".lock"}
    assert after == {k: v for k, v in before.items() if k != ".lock"}  # nothing written, nothing removed


@pytest.mark.parametrize("old,new,words", [
    ('spec = "tiny"', 'spec = "huge"', "model.spec: unknown workload 'huge'"),
    ('source = "stdlib"', 'source = "/nonexistent/corpus"', "data.source: corpus path '/nonexistent/corpus' does not exist"),
])
def test_a_manifests_unknown_model_or_missing_corpus_is_refused_before_anything_is_written(tmp_path, old, new, words):
    # these used to fail after STATE_DIR/identity.key and its lock were made, without naming the key or file
    text = (Path(__file__).resolve().parents[1] / "scripts" / "example_run.toml").read_text()
    assert old in text
    (tmp_path / "run.toml").write_text(text.replace(old, new))
    res = CliRunner().invoke(app, ["launch", str(tmp_path / "run.toml"), "--state-dir", str(tmp_path / "state"),
                                   "--listen", "/ip4/127.0.0.1/tcp/0", "--quiet"])
    _one_error_line(res, 2, f"{tmp_path / 'run.toml'}: {words}")
    assert not (tmp_path / "state").exists()


@pytest.mark.parametrize("make_identity,words", [
    (lambda p: p.write_text("garbage"), "not a libp2p private key"),
    (lambda p: p.mkdir(), "is a folder, not an identity file"),
])
def test_a_bad_identity_file_is_one_error_line(tmp_path, make_identity, words):
    key = tmp_path / "bad.key"
    make_identity(key)
    res = CliRunner().invoke(app, ["join", _bootstrap(_unused_port()), "--identity", str(key),
                                   "--state-dir", str(tmp_path / "peer")])
    _one_error_line(res, 2, words)
    assert not (tmp_path / "peer").exists()  # refused before anything is made (a review found a .lock left)


@pytest.mark.parametrize("device,words", [("gpu", "--device must be cpu, cuda or cuda:N"),
                                          ("meta", "--device must be cpu, cuda or cuda:N")])
def test_a_bad_device_is_one_error_line_before_anything_is_written(tmp_path, device, words):
    res = CliRunner().invoke(app, ["join", _bootstrap(_unused_port()), "--device", device,
                                   "--state-dir", str(tmp_path / "peer")])
    _one_error_line(res, 2, words)
    assert not (tmp_path / "peer").exists()


@pytest.mark.parametrize("device,words", [("gpu", "--device must be cpu, cuda or cuda:N"),
                                          ("cuda:99", "--device cuda")])
def test_a_coordinators_bad_device_is_one_error_line_before_anything_is_written(tmp_path, device, words):
    manifest = Path(__file__).resolve().parents[1] / "scripts" / "example_run.toml"
    res = CliRunner().invoke(app, ["launch", str(manifest), "--device", device, "--state-dir", str(tmp_path / "run")])
    _one_error_line(res, 2, words)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("command", [["train-local", "--steps", "1"], ["bench", "codecs", "--params", "1000"]])
@pytest.mark.parametrize("device,words", [("gpu", "--device must be cpu, cuda or cuda:N"),
                                          ("cuda:99", "--device cuda")])
def test_a_bad_device_for_local_commands_is_one_error_line(command, device, words):
    _one_error_line(CliRunner().invoke(app, [*command, "--device", device]), 2, words)


def test_error_lines_keep_the_brackets_of_what_they_quote(tmp_path):
    # rich would read "[a-z0-9-]" or "[run]" as markup and drop it from the message
    manifest = tmp_path / "run.toml"
    manifest.write_text('[run]\nid = "Example Tiny"\nopen = true\n')
    _one_error_line(CliRunner().invoke(app, ["launch", str(manifest)]), 2, "characters of [a-z0-9-]")
    manifest.write_text("")
    _one_error_line(CliRunner().invoke(app, ["launch", str(manifest)]), 2, "[run]")


def test_simulate_clears_an_earlier_simulations_output_and_refuses_a_folder_of_other_files(tmp_path):
    # left in place, the old bootstrap address and event logs would feed the new run and its report
    from groundswell.peer.simulate import MARKER, SimulationError, clear_output

    out = tmp_path / "sim"
    clear_output(out)  # a new folder: made, and marked as a simulation's
    assert [p.name for p in out.iterdir()] == [MARKER]
    for path in ("coordinator/bootstrap.txt", "peer-0/events.jsonl", "late-0/events.jsonl", "peer-1.log",
                 "report.json", "loss.png", "run.toml"):
        (out / path).parent.mkdir(parents=True, exist_ok=True)
        (out / path).write_text("old")
    clear_output(out)
    assert [p.name for p in out.iterdir()] == [MARKER]
    (out / "notes.txt").write_text("mine")
    with pytest.raises(SimulationError, match="holds files a simulation does not write"):
        clear_output(out)
    assert (out / "notes.txt").read_text() == "mine"
    res = CliRunner().invoke(app, ["simulate", "--peers", "1", "--rounds", "1", "--out", str(out)])
    _one_error_line(res, 2, "notes.txt")
    # a real coordinator's state folder looks like a simulation's, but no simulation marked it
    real = tmp_path / "real"
    (real / "coordinator").mkdir(parents=True)
    (real / "coordinator" / "identity.key").write_text("the run's signing key")
    (real / "run.toml").write_text("[run]")
    with pytest.raises(SimulationError, match="no mark of an earlier simulation"):
        clear_output(real)
    assert (real / "coordinator" / "identity.key").exists()
    # a folder under a file: the flag and the file named (it was a bare "[Errno 20] Not a directory")
    (tmp_path / "afile").write_text("x")
    res = CliRunner().invoke(app, ["simulate", "--peers", "1", "--rounds", "1", "--out", str(tmp_path / "afile" / "sub")])
    _one_error_line(res, 2, f"--out {tmp_path / 'afile' / 'sub'} cannot be created: {tmp_path / 'afile'} is a file")
    # a mistyped path is not made whole (a review's `--out /nonexistent/x` made /nonexistent, as root)
    res = CliRunner().invoke(app, ["simulate", "--peers", "1", "--rounds", "1", "--out", str(tmp_path / "typo" / "x")])
    _one_error_line(res, 2, f"--out {tmp_path / 'typo' / 'x'}: {tmp_path / 'typo'} does not exist (a typo?)")
    assert not (tmp_path / "typo").exists()


def test_options_are_checked_before_the_state_dir_is_written(tmp_path):
    manifest = Path(__file__).resolve().parents[1] / "scripts" / "example_run.toml"
    res = CliRunner().invoke(app, ["launch", str(manifest), "--state-port", "70000", "--state-dir", str(tmp_path / "run")])
    _one_error_line(res, 2, "--state-port must be -1 (off), 0 (any free port) or a port number")
    res = CliRunner().invoke(app, ["join", _bootstrap(_unused_port()), "--reachability", "sometimes",
                                   "--state-dir", str(tmp_path / "peer")])
    _one_error_line(res, 2, "--reachability must be auto, public or private")
    assert not (tmp_path / "run").exists() and not (tmp_path / "peer").exists()


def test_joining_with_the_coordinators_identity_is_refused(tmp_path):
    key = tmp_path / "coord.key"
    ident = Identity.generate()
    ident.save(key)
    line = f"gs1:{ident.peer_id}@/ip4/127.0.0.1/tcp/{_unused_port()}/p2p/{ident.peer_id}"
    res = CliRunner().invoke(app, ["join", line, "--identity", str(key), "--state-dir", str(tmp_path / "peer")])
    _one_error_line(res, 2, "is the coordinator's identity: a volunteer needs its own --identity")


def test_train_local_set_below_a_plain_value_and_a_binary_config_are_one_error_line(tmp_path):
    res = CliRunner().invoke(app, ["train-local", "--set", "workers.x=1"])
    _one_error_line(res, 2, "unknown key 'workers.x'")
    binary = tmp_path / "run.toml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    res = CliRunner().invoke(app, ["train-local", "--config", str(binary)])
    _one_error_line(res, 2, "not valid TOML")


def test_the_cli_module_run_as_a_script_has_every_command():
    out = subprocess.run([sys.executable, "-m", "groundswell.peer.cli", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    for command in ("keygen", "launch", "join", "status", "simulate", "train-local", "bench"):
        assert command in out.stdout, out.stdout


def test_an_event_log_on_a_full_disk_drops_events_and_training_goes_on(caplog):
    from groundswell.peer.event_log import EventLog

    log = EventLog(Path("/dev/full"))  # every write fails with ENOSPC
    log.write("round", round=1)
    log.write("round", round=2)
    assert log.failed == 2
    assert sum("cannot write the event log" in r.getMessage() for r in caplog.records) == 1  # said once


@pytest.mark.parametrize("args", [["--params", "-5"], ["--params", "10", "--repeats", "0"]])
def test_bad_codec_bench_sizes_are_one_error_line(args):
    res = CliRunner().invoke(app, ["bench", "codecs", *args])  # was a traceback
    _one_error_line(res, 2, "--params and --repeats must be positive")


def test_an_event_after_a_line_cut_short_starts_a_line_of_its_own(tmp_path):
    # A kill (or a full disk) mid-write leaves a last line without its newline; the next run's
    # first event used to be glued to it and lost with it.
    from groundswell.peer.event_log import EventLog
    from groundswell.peer.sim_report import read_events

    path = tmp_path / "events.jsonl"
    path.write_text('{"t": 1, "kind": "round", "round": 0}\n{"t": 2, "kind": "rou')
    log = EventLog(path)
    log.write("round", round=1)
    log.write("round", round=2)
    assert [e.get("round") for e in read_events(path)] == [0, 1, 2]
    assert path.read_text().count("\n") == 4  # one newline for the torn line, none doubled after it


@pytest.mark.parametrize("command", ["launch", "join"])
def test_an_identity_path_that_does_not_exist_is_refused_not_created(tmp_path, command):
    # A mistyped --identity used to make a new key: a coordinator restarted that way came back as
    # another peer, its run's bootstrap line dead and its manifest's signer a stranger.
    manifest = Path(__file__).resolve().parents[1] / "scripts" / "example_run.toml"
    first = [str(manifest)] if command == "launch" else [_bootstrap(_unused_port())]
    key = tmp_path / "coordinatr.key"
    res = CliRunner().invoke(app, [command, *first, "--identity", str(key), "--state-dir", str(tmp_path / "s"),
                                   "--listen", "/ip4/127.0.0.1/tcp/0"])
    _one_error_line(res, 2, f"no identity at {key}: create one with `groundswell keygen {key}`")
    assert not key.exists()


def test_a_state_dir_launched_with_another_manifest_or_key_is_refused(tmp_path):
    # Volunteers keep the manifest they verified on joining: a coordinator back on its state dir
    # with other settings under the same run id (or under another key) would split the swarm.
    import dataclasses

    from groundswell.peer.config import ConfigError
    from groundswell.peer.launch_checks import record_run as _record_run
    from groundswell.peer.launch_checks import same_run_as_before as _same_run_as_before
    from groundswell.peer.manifest import SignedManifest, load_manifest_toml, sign_manifest

    manifest = load_manifest_toml(Path(__file__).resolve().parents[1] / "scripts" / "example_run.toml")
    key = Identity.generate()
    state = tmp_path / "run-1"
    state.mkdir()
    first = sign_manifest(manifest, key).to_bytes()
    _same_run_as_before(state, first)
    assert not (state / "manifest.signed").exists()  # recorded only once the network is up
    _record_run(state, first)
    assert (state / "manifest.signed").read_bytes() == first
    _same_run_as_before(state, sign_manifest(manifest, key).to_bytes())  # a restart as it was: fine
    edited = dataclasses.replace(manifest, round=dataclasses.replace(manifest.round, deadline_s=99.0))
    with pytest.raises(ConfigError, match="another manifest: resume it with the same manifest and --identity"):
        _same_run_as_before(state, sign_manifest(edited, key).to_bytes())
    with pytest.raises(ConfigError, match=r"another coordinator key \(--identity\)"):
        _same_run_as_before(state, sign_manifest(manifest, Identity.generate()).to_bytes())
    moved = dataclasses.replace(manifest, data=dataclasses.replace(manifest.data, fingerprint="ab" * 8))
    with pytest.raises(ConfigError, match=r"another copy of its dataset \(data.source's files or sizes changed"):
        _same_run_as_before(state, sign_manifest(moved, key).to_bytes())
    # A run launched by a version that signed no model.layout (this manifest's bytes are those of
    # one: an empty layout is left out, so theirs still verify) resumes as it ran (a review)
    from groundswell.peer.launch_checks import as_first_launched

    rebuilt = dataclasses.replace(manifest, model=dataclasses.replace(manifest.model, layout="cd" * 16))
    assert b"layout" not in SignedManifest.from_bytes(first).manifest_bytes
    kept = as_first_launched(state, rebuilt)
    assert kept.model.layout == "" and kept == manifest
    _same_run_as_before(state, sign_manifest(kept, key).to_bytes())
    assert as_first_launched(state, dataclasses.replace(rebuilt, round=edited.round)).model.layout == "cd" * 16
    with pytest.raises(ConfigError, match="another groundswell version"):  # the first signed none
        _same_run_as_before(state, sign_manifest(rebuilt, key).to_bytes())
    assert (state / "manifest.signed").read_bytes() == first  # what was refused left nothing behind
    _record_run(state, sign_manifest(rebuilt, key).to_bytes())
    changed = dataclasses.replace(manifest, model=dataclasses.replace(manifest.model, layout="ef" * 16))
    with pytest.raises(ConfigError, match=r"another model \(model.spec now builds parameters of other names"):
        _same_run_as_before(state, sign_manifest(changed, key).to_bytes())


def test_a_run_launched_with_identity_elsewhere_is_refused_before_a_new_key_is_made(tmp_path):
    manifest = Path(__file__).resolve().parents[1] / "scripts" / "example_run.toml"
    state = tmp_path / "run"
    state.mkdir()
    (state / "manifest.signed").write_bytes(b"launched before with --identity elsewhere")
    res = CliRunner().invoke(app, ["launch", str(manifest), "--state-dir", str(state), "--quiet"])
    _one_error_line(res, 2, f"{state} holds a run launched with --identity elsewhere: resume it with the same --identity")
    assert not (state / "identity.key").exists()  # no stray key, to be refused again next time


def test_keygen_into_a_folder_it_cannot_write_names_the_file_asked_for(tmp_path, monkeypatch):
    import tempfile

    def refuse(*args, dir=None, **kwargs):  # root may write anywhere: stand in for the OS refusing
        raise PermissionError(13, "Permission denied", str(Path(dir) / ".id.key.x1y2.tmp"))

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    res = CliRunner().invoke(app, ["keygen", str(tmp_path / "id.key")])
    _one_error_line(res, 2, f"cannot write {tmp_path / 'id.key'}: Permission denied")
    assert ".tmp" not in res.output


@pytest.mark.parametrize("args, words", [
    (["--table", "--steps", "5"], ("--table runs its fixed rows and takes only --jobs, --quick, --threads, --out "
                                   "and --json, not --steps")),
    (["--table", "--preset", "small", "--set", "inner.lr=1"], "not --model, --set"),
    (["--config", "nowhere.toml"], "--config nowhere.toml: no such file"),
])
def test_train_local_flags_it_would_ignore_or_cannot_read_are_one_error_line(args, words):
    _one_error_line(CliRunner().invoke(app, ["train-local", *args]), 2, words)


def test_train_local_takes_preset_as_another_name_for_model():
    by_model = CliRunner().invoke(app, ["train-local", "--model", "no-such-preset", "--steps", "1"])
    by_preset = CliRunner().invoke(app, ["train-local", "--preset", "no-such-preset", "--steps", "1"])
    _one_error_line(by_preset, 2, "no-such-preset")
    assert by_preset.output == by_model.output


def test_a_training_that_diverged_is_one_error_line(monkeypatch):
    from groundswell.peer import train_local

    def diverged(cfg, progress=None):
        raise FloatingPointError("inner step 7: gradient norm is inf: training diverged; try a lower inner.lr (now 3)")

    monkeypatch.setattr(train_local, "run_train_local", diverged)
    res = CliRunner().invoke(app, ["train-local", "--steps", "1"])  # was a traceback and exit code 1
    _one_error_line(res, 2, "error: inner step 7: gradient norm is inf: training diverged; try a lower inner.lr")


def test_a_volunteers_state_dir_is_refused_to_another_identity_or_run(tmp_path):
    # Its unsent work and open contributions are one peer's: read under another peer id, a
    # contribution the round counted looks uncounted and its work would be sent (applied) twice;
    # a checkpoint of another coordinator's run with the same id would be taken for this run's.
    from groundswell.peer.config import ConfigError
    from groundswell.peer.volunteer_dir import VOLUNTEER_FILE, bind_volunteer_dir, check_volunteer_dir

    state = tmp_path / "peer"
    state.mkdir()
    assert check_volunteer_dir(state, "peerA", "coordC", "run-1")  # unbound: bound once its checkpoint is accepted
    bind_volunteer_dir(state, "peerA", "coordC", "run-1")
    bound = (state / VOLUNTEER_FILE).read_bytes()
    assert not check_volunteer_dir(state, "peerA", "coordC", "run-1")  # a restart as it was: fine
    with pytest.raises(ConfigError, match="holds the work of peer peerA, not of this identity .peerB."):
        check_volunteer_dir(state, "peerB", "coordC", "run-1")
    with pytest.raises(ConfigError, match="holds run 'run-1' of coordinator coordC, not run 'run-1' of coordD"):
        check_volunteer_dir(state, "peerA", "coordD", "run-1")
    with pytest.raises(ConfigError, match="not run 'run-2'"):
        check_volunteer_dir(state, "peerA", "coordC", "run-2")
    assert (state / VOLUNTEER_FILE).read_bytes() == bound  # what was refused changed nothing
    (state / VOLUNTEER_FILE).write_bytes(b"\xff{garbled")
    with pytest.raises(ConfigError, match="is unreadable"):
        check_volunteer_dir(state, "peerA", "coordC", "run-1")


def test_a_folder_an_older_version_left_unbound_keeps_its_work_for_its_own_identity(tmp_path):
    from groundswell.peer.config import ConfigError
    from groundswell.peer.volunteer_dir import check_volunteer_dir

    old = tmp_path / "old"
    old.mkdir()
    own = Identity.generate()
    own.save(old / "identity.key")
    assert check_volunteer_dir(old, "someone-else", "coordC", "run-1")  # no unsent work in it: any identity
    (old / "work.pt").write_bytes(b"unsent work")
    with pytest.raises(ConfigError, match=f"holds the work of peer {own.peer_id} .its identity.key."):
        check_volunteer_dir(old, "someone-else", "coordC", "run-1")
    assert check_volunteer_dir(old, own.peer_id, "coordC", "run-1")


def test_a_lock_whose_pid_cannot_be_written_is_released_and_named(tmp_path, monkeypatch):
    # A full disk at the pid write left the file locked by a descriptor nobody held, so a second
    # try in this process was refused as "in use by another process", and the error named no file.
    import errno
    import os

    from groundswell.peer import locks
    from groundswell.peer.config import ConfigError

    lock = tmp_path / ".lock"
    real_write = os.write

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(locks.os, "write", full)
    with pytest.raises(ConfigError, match=r"\.lock: No space left on device"):
        locks.hold_exclusively(lock, "state dir", tmp_path)
    monkeypatch.setattr(locks.os, "write", real_write)
    locks.hold_exclusively(lock, "state dir", tmp_path)  # free again, taken now
    assert str(lock.resolve()) in locks._HELD
    os.close(locks._HELD.pop(str(lock.resolve())))


def test_a_volunteer_dir_of_another_launch_of_the_run_is_refused(tmp_path):
    # A coordinator that launched its run anew (a fresh state dir, other settings) under the same
    # run id and key: a volunteer resumed its old checkpoint into it, and the coordinator took
    # that state as the majority's word; the new genesis was lost without a word.
    import json

    from groundswell.peer.config import ConfigError
    from groundswell.peer.volunteer_dir import VOLUNTEER_FILE, bind_volunteer_dir, check_volunteer_dir

    state = tmp_path / "state"
    state.mkdir()
    assert check_volunteer_dir(state, "peerA", "coordC", "run-1", "m1")
    bind_volunteer_dir(state, "peerA", "coordC", "run-1", "m1")
    assert not check_volunteer_dir(state, "peerA", "coordC", "run-1", "m1")  # the coordinator resumed: same manifest
    with pytest.raises(ConfigError, match="another launch of run 'run-1'"):
        check_volunteer_dir(state, "peerA", "coordC", "run-1", "m2")
    # A binding an older version wrote (no manifest) is taken, and asked to be bound again with it.
    (state / VOLUNTEER_FILE).write_text(json.dumps({"peer_id": "peerA", "coordinator": "coordC", "run_id": "run-1"}))
    assert check_volunteer_dir(state, "peerA", "coordC", "run-1", "m2")
    bind_volunteer_dir(state, "peerA", "coordC", "run-1", "m2")
    assert json.loads((state / VOLUNTEER_FILE).read_text())["manifest"] == "m2"
    assert not check_volunteer_dir(state, "peerA", "coordC", "run-1", "m2")


@pytest.mark.parametrize("command", ["join", "launch"])
def test_a_state_dir_others_can_write_to_is_refused_before_anything_is_written(tmp_path, monkeypatch, command):
    # Another local user who may write there can plant links where our files go, or a checkpoint
    # of their choosing for a coordinator to resume from and serve (found by a review). Run as a
    # user (root may use any folder: a container's, mounted from its host).
    import os

    user = os.getuid() or 1000
    if os.getuid() == 0:
        monkeypatch.setattr(os, "getuid", lambda: user)
    shared = tmp_path / "shared"
    shared.mkdir()
    if hasattr(os, "chown") and os.geteuid() == 0:
        os.chown(shared, user, user)
    os.chmod(shared, 0o777)
    manifest = Path(__file__).resolve().parents[1] / "scripts" / "example_run.toml"
    first = _bootstrap(_unused_port()) if command == "join" else str(manifest)
    res = CliRunner().invoke(app, [command, first, "--state-dir", str(shared)])
    _one_error_line(res, 2, f"--state-dir {shared} is writable by every user (mode 777)")
    assert list(shared.iterdir()) == []
    os.chmod(shared, 0o1777)  # sticky, as /tmp
    res = CliRunner().invoke(app, [command, first, "--state-dir", str(shared)])
    _one_error_line(res, 2, f"--state-dir {shared} is a shared folder (mode 1777)")
    if os.geteuid() == 0:  # root can give a folder away: one of another user's is refused too
        os.chmod(shared, 0o700)
        os.chown(shared, 65534, 65534)
        res = CliRunner().invoke(app, [command, first, "--state-dir", str(shared)])
        _one_error_line(res, 2, f"--state-dir {shared} is another user's")
    assert list(shared.iterdir()) == []


def test_a_group_writable_state_dir_of_ones_own_passes(tmp_path, monkeypatch):
    # umask 002 (Ubuntu's and Fedora's default for users) makes folders 0775: their group is the
    # user's own, so refusing them refused most folders users had made themselves.
    import os

    from groundswell.peer.state_files import refuse_shared_state_dir

    user = os.getuid() or 1000
    if os.getuid() == 0:
        monkeypatch.setattr(os, "getuid", lambda: user)
        os.chown(tmp_path, user, user)
    os.chmod(tmp_path, 0o775)
    refuse_shared_state_dir(tmp_path)
    monkeypatch.setattr(os, "getuid", lambda: 0)  # root: any folder
    os.chmod(tmp_path, 0o777)
    refuse_shared_state_dir(tmp_path)


def test_a_state_dir_through_a_link_another_user_made_is_refused(tmp_path, monkeypatch):
    # Found by a review: a link another user planted (in /tmp, say) pointing at a folder of ours
    # passed the check, and could be pointed at a folder of theirs once the peer ran.
    import os

    from groundswell.peer.config import ConfigError
    from groundswell.peer.state_files import refuse_shared_state_dir

    if os.getuid() != 0:
        pytest.skip("making a link owned by another user needs root")
    user = 1000
    ours = tmp_path / "ours"
    ours.mkdir(mode=0o700)
    os.chown(ours, user, user)
    planted = tmp_path / "groundswell-peer"
    planted.symlink_to(ours)
    os.lchown(planted, 4321, 4321)
    monkeypatch.setattr(os, "getuid", lambda: user)
    with pytest.raises(ConfigError, match="a link another user made"):
        refuse_shared_state_dir(planted)
    with pytest.raises(ConfigError, match="a link another user made"):
        refuse_shared_state_dir(planted / "inner")  # (a folder below one is refused too)
    os.lchown(planted, user, user)  # a link of our own (to a disk with room, say) is fine
    refuse_shared_state_dir(planted)


def test_the_event_log_never_appends_through_a_link(tmp_path):
    from groundswell.peer.event_log import EventLog

    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text("theirs\n")
    (tmp_path / "events.jsonl").symlink_to(elsewhere)
    log = EventLog(tmp_path / "events.jsonl")
    log.write("start", peer="p")
    assert elsewhere.read_text() == "theirs\n" and log.failed == 1


def test_a_restarted_volunteer_says_what_it_resumed_from():
    # Found by a review: a restart printed what a fresh join prints; only events.jsonl said it resumed.
    from groundswell.peer.cli_output import resumed_line
    from groundswell.peer.roles import resume_summary

    said = resumed_line(Path("v1"), resume_summary({"round": 1204}, 1210, [{"round": 1205}]))
    assert said == ("resumed from v1: its checkpoint at the start of round 1204; settling the contributions sent before the stop "
                    "(round 1205) against their commits; now at round 1210")
    said = resumed_line(Path("v1"), resume_summary({"work_only": True, "round": 3}, 5, [{"round": 4}, {"round": 3}]))
    assert said == ("resumed from v1: the work not yet sent (no readable checkpoint); settling the contributions "
                    "sent before the stop (rounds 3, 4) against their commits; now at round 5")
    # a round's retried attempts, each open: the round is named once (it read "rounds 4, 4"; a review)
    said = resumed_line(Path("v1"), resume_summary({"round": 3}, 5, [{"round": 4}, {"round": 4}]))
    assert "(round 4) against" in said


def test_the_codec_bench_says_a_slower_decode_as_slower():
    from groundswell.peer.bench_codecs import _times

    assert (_times(2.5), _times(0.2)) == ("2.50x faster", "5.00x slower")  # not "0.20x faster" (a review)


def test_a_mistyped_coordinator_id_in_the_bootstrap_line_says_so_plainly():
    from groundswell.peer.bootstrap import BootstrapError, parse_bootstrap
    from groundswell.protocol.identity import Identity

    good = Identity.generate().peer_id
    bad = good[:-3]  # cut short in the copy
    with pytest.raises(BootstrapError, match="not a valid peer id .*mistyped"):
        parse_bootstrap(f"gs1:{bad}@/ip4/127.0.0.1/tcp/1/p2p/{good}")


@pytest.mark.parametrize("command", [[], ["bench"], ["bench", "codecs"], ["keygen"], ["launch"], ["join"],
                                     ["status"], ["simulate"], ["train-local"]])
def test_help_names_values_as_click_does_and_flags_take_none(command):
    # typer 0.29 wrote `--quiet <bool>`, `--state-dir <path>`, `--listen <list[str]>`: read as a
    # value to type after a flag; with `--no-allow-model-code` beside them, the help text of
    # `join` was cut short ("STATE_DIR/events.jso…") in an 80-column terminal
    res = CliRunner().invoke(app, [*command, "--help"], terminal_width=80, env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    options = res.output[res.output.index("Options"):]
    assert "--help" in options and not any(t in res.output for t in ("<bool>", "<int>", "<str>", "<path>", "<list[")), \
        res.output
    assert "…" not in res.output, res.output
    if command in (["join"], ["launch"]):
        assert "PATH" in options and "INTEGER" in options
    if command == ["keygen"]:  # its argument's type column too
        assert re.search(r"PATH +PATH +Where to write", res.output), res.output


def test_log_lines_go_through_the_stderr_in_place_when_they_are_written():
    # rich's live table and progress bar redirect sys.stderr while they run and print what comes
    # through above themselves; a handler bound to the real stderr at start glued its lines onto
    # the table's border (a review, 2026-12-07).
    import io
    import logging
    import sys

    from groundswell.peer.cli_output import setup_logging

    root = logging.getLogger()
    saved = (root.level, list(root.handlers))
    root.handlers[:] = []  # (basicConfig adds nothing to a root that has handlers)
    real, redirected = sys.stderr, io.StringIO()
    try:
        setup_logging(verbose=False)
        sys.stderr = redirected
        logging.getLogger("groundswell.test").warning("a line for the user")
    finally:
        sys.stderr = real
        root.handlers[:] = saved[1]
        root.setLevel(saved[0])
    assert "a line for the user" in redirected.getvalue()


def test_version_is_printed_and_nothing_else_runs():
    from groundswell.peer.cli import app
    from typer.testing import CliRunner

    res = CliRunner().invoke(app, ["--version"])
    assert res.exit_code == 0 and res.output.startswith("groundswell "), res.output
