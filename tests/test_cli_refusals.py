"""Flags that could never take effect, or could not be used as given, are refused in one `error:`
line naming the flag, before anything is written or started; a launch that never started its
network leaves its state dir free for a corrected manifest."""

from __future__ import annotations

import errno
import logging
from pathlib import Path

import pytest
from groundswell.peer.cli import app
from groundswell.protocol.identity import Identity
from typer.testing import CliRunner

pytestmark = pytest.mark.timeout(120)

EXAMPLE = Path(__file__).resolve().parents[1] / "scripts" / "example_run.toml"


def _bootstrap() -> str:
    pid = Identity.generate().peer_id
    return f"gs1:{pid}@/ip4/127.0.0.1/tcp/9/p2p/{pid}"  # never dialled: every case is refused before


@pytest.fixture
def nothing_starts(monkeypatch):
    """No network, simulation or training starts (were a refusal missed, the test fails at once),
    and no signal handler is left in pytest."""
    from groundswell.peer import cli_swarm, simulate, train_local
    from groundswell.peer.participant import Participant
    from groundswell.peer.stop_flag import StopFlag
    from groundswell.peer.swarm import SwarmNode

    def started(*args, **kwargs):
        raise AssertionError("started")

    for owner, name in ((Participant, "start_network"), (SwarmNode, "start"), (simulate, "run_simulation"),
                        (train_local, "run_train_local")):
        monkeypatch.setattr(owner, name, started)
    monkeypatch.setattr(cli_swarm, "_stop_on_signals", lambda first="": StopFlag())


def _one_error_line(res, words: str) -> None:
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert "Traceback" not in res.output and lines[0].startswith("error:"), res.output
    assert words in " ".join(res.output.split()), res.output


@pytest.mark.parametrize("args, words", [
    (["--listen", "garbage"], "--listen: Invalid MultiAddr 'garbage'"),
    (["--announce", "/ip4/1.2.3.4/tcp/99999"], "--announce: Invalid MultiAddr"),
    (["--peer", "/ip4/127.0.0.1/tcp/9"], "--peer '/ip4/127.0.0.1/tcp/9' must end in /p2p/<peer id>"),
    # held to a bootstrap address's rules (it was not, and an /ipfs/ spelling crashed the DHT's start)
    (["--peer", f"/ip4/127.0.0.1/p2p/{Identity.generate().peer_id}"], "names no transport"),
    (["--announce", "/ip4/1.2.3.4/udp/9"], "--announce '/ip4/1.2.3.4/udp/9' must be an address others dial"),
    (["--announce", f"/ip4/1.2.3.4/tcp/9/p2p/{Identity.generate().peer_id}"], "and no /p2p/"),
])
def test_launch_refuses_a_malformed_multiaddr_before_writing_anything(tmp_path, nothing_starts, args, words):
    res = CliRunner().invoke(app, ["launch", str(EXAMPLE), "--state-dir", str(tmp_path / "sd"), "--quiet", *args])
    _one_error_line(res, words)
    assert not (tmp_path / "sd").exists()


def test_join_refuses_a_malformed_listen_address_before_writing_anything(tmp_path, nothing_starts):
    res = CliRunner().invoke(app, ["join", _bootstrap(), "--listen", "garbage", "--state-dir", str(tmp_path / "p")])
    _one_error_line(res, "--listen: Invalid MultiAddr 'garbage'")
    assert not (tmp_path / "p").exists()


def test_a_launch_whose_network_did_not_start_does_not_bind_the_state_dir_to_its_manifest(tmp_path, monkeypatch,
                                                                                         nothing_starts):
    from groundswell.peer import bootstrap
    from groundswell.peer.net_errors import NetworkError
    from groundswell.peer.participant import Participant

    def no_network(self):
        raise NetworkError("could not start the network: the daemon said no")

    monkeypatch.setattr(Participant, "start_network", no_network)
    state, fixed = tmp_path / "sd", tmp_path / "fixed.toml"
    fixed.write_text(EXAMPLE.read_text().replace("deadline_s = 30.0", "deadline_s = 40.0"))
    launch = ["launch", "--state-dir", str(state), "--quiet"]
    _one_error_line(CliRunner().invoke(app, [launch[0], str(EXAMPLE), *launch[1:]]), "could not start the network")
    assert not (state / "manifest.signed").exists()
    # relaunched with a corrected manifest: refused for the network again, not for "another manifest"
    _one_error_line(CliRunner().invoke(app, [launch[0], str(fixed), *launch[1:]]), "could not start the network")

    def interrupted(*args, **kwargs):  # once the network is up: stop there, the run recorded
        raise KeyboardInterrupt

    monkeypatch.setattr(Participant, "start_network", lambda self: None)
    monkeypatch.setattr(bootstrap, "format_bootstrap", interrupted)
    assert CliRunner().invoke(app, [launch[0], str(fixed), *launch[1:]]).exit_code == 130
    assert (state / "manifest.signed").exists()
    # a restart as it was resumes; another manifest is refused as before
    assert CliRunner().invoke(app, [launch[0], str(fixed), *launch[1:]]).exit_code == 130
    _one_error_line(CliRunner().invoke(app, [launch[0], str(EXAMPLE), *launch[1:]]),
                    f"{state} holds a run launched with another manifest")


@pytest.mark.parametrize("args, words", [
    (["--restart-after", "5"], "--restart-after does nothing without --kill-every or --kill-coordinator-at"),
    (["--restart-after", "0"], "--restart-after does nothing without --kill-every"),  # given, even as its default
    (["--freeze-for", "10"], "--freeze-for does nothing without --freeze-every"),
    (["--attack", "scale"], "--attack does nothing without --byzantine"),
    (["--algorithm", "diloco", "--topk", "32"], "--topk does nothing with the fp32 codec (--algorithm diloco)"),
    (["--algorithm", "diloco", "--error-decay", "0.5"], "--error-decay does nothing with --algorithm diloco"),
    (["--checkpoint-every", "0"], "--checkpoint-every must be at least 1, got 0"),  # not checkpoint.keep
    (["--topk", "0"], "--topk must be at least 1, got 0"),  # ran silently with the default, 64
    (["--timeout", "0"], "--timeout must be a finite number of seconds > 0, got 0.0"),
])
def test_simulate_refuses_flags_that_could_never_take_effect(tmp_path, nothing_starts, args, words):
    res = CliRunner().invoke(app, ["simulate", *args, "--out", str(tmp_path / "sim")])
    _one_error_line(res, words)
    assert "checkpoint.keep" not in res.output
    assert not (tmp_path / "sim").exists()


def test_simulate_options_refuse_what_a_programmatic_caller_set_to_no_effect():
    from groundswell.peer.config import ConfigError
    from groundswell.peer.simulate import SimulateOptions

    with pytest.raises(ConfigError, match="--restart-after does nothing"):
        SimulateOptions(restart_after=5)
    with pytest.raises(ConfigError, match="--attack does nothing"):
        SimulateOptions(attack="signflip")
    SimulateOptions(kill_coordinator_at=3, restart_after=5)  # the coordinator restarts after it
    SimulateOptions(peers=4, byzantine=1, attack="signflip", freeze_every=5, freeze_for=10)
    SimulateOptions(algorithm="diloco")  # the defaults stay quiet


@pytest.mark.parametrize("args, words", [
    (["--max-rounds", "0"], "--max-rounds must be at least 1, not 0"),
    (["--max-rounds", "-1"], "--max-rounds must be at least 1, not -1"),
    (["--until-round", "-2"], "--until-round must be at least 1 (the run starts at round 0), not -2"),
    (["--until-round", "0"], "--until-round must be at least 1"),
    (["--threads", "-5"], "--threads must be 0 (torch's default) or more, not -5"),
])
def test_join_refuses_a_round_count_that_would_leave_at_once(tmp_path, nothing_starts, args, words):
    res = CliRunner().invoke(app, ["join", _bootstrap(), *args, "--state-dir", str(tmp_path / "p")])
    _one_error_line(res, words)
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("command", ["join", "launch"])
def test_a_state_dir_that_is_a_file_or_an_identity_that_is_a_folder_names_the_flag(tmp_path, nothing_starts,
                                                                                    command):
    first = [str(EXAMPLE)] if command == "launch" else [_bootstrap()]
    (tmp_path / "f").write_text("")
    (tmp_path / "d").mkdir()
    res = CliRunner().invoke(app, [command, *first, "--state-dir", str(tmp_path / "f")])
    _one_error_line(res, f"--state-dir {tmp_path / 'f'} is a file, not a folder")
    res = CliRunner().invoke(app, [command, *first, "--state-dir", str(tmp_path / "f" / "s")])
    _one_error_line(res, f"--state-dir {tmp_path / 'f' / 's'} cannot be created: {tmp_path / 'f'} is a file")
    res = CliRunner().invoke(app, [command, *first, "--identity", str(tmp_path / "d"), "--state-dir",
                                   str(tmp_path / "s")])
    _one_error_line(res, f"--identity {tmp_path / 'd'} is a folder, not an identity file")


def test_keygen_below_a_file_or_where_it_cannot_write_says_so_about_the_path_asked_for(tmp_path, monkeypatch):
    import tempfile

    (tmp_path / "f").write_text("")
    res = CliRunner().invoke(app, ["keygen", str(tmp_path / "f" / "x.key")])
    _one_error_line(res, f"{tmp_path / 'f'} is not a folder")
    assert "does not exist" not in res.output

    def read_only(*args, dir=None, **kwargs):  # EROFS, not EACCES: used to name the temp file
        raise OSError(errno.EROFS, "Read-only file system", str(Path(dir) / ".id.key.x1y2.tmp"))

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    res = CliRunner().invoke(app, ["keygen", str(tmp_path / "id.key")])
    _one_error_line(res, f"cannot write {tmp_path / 'id.key'}: Read-only file system")
    assert ".tmp" not in res.output


@pytest.mark.parametrize("args, words", [
    (["--jobs", "2"], "--jobs goes with --table only"),
    (["--jobs", "1"], "--jobs goes with --table only"),  # given, even as its default
    (["--quick"], "--quick goes with --table only"),
    (["--threads", "-5"], "--threads must be 0 (torch's default) or more, not -5"),
    (["--seed", "99999999999999999999"], "seed must be in [0, 2**63)"),  # review: a traceback from torch
    (["--seed", "-1"], "seed must be in [0, 2**63)"),
    (["--config", "."], "--config .: a folder, not a file"),
    (["--data", ""], "data.source must name"),
])
def test_train_local_refuses_table_flags_without_table_before_training(nothing_starts, args, words):
    _one_error_line(CliRunner().invoke(app, ["train-local", *args]), words)


def test_a_manifest_signed_by_another_key_is_not_a_warning_the_cli_repeats(caplog):
    # join/status already say why in their one error line: a WARN log line before it was noise
    import asyncio
    from types import SimpleNamespace

    from groundswell.peer.swarm import ManifestRefused, SwarmNode

    class Transport:
        async def request(self, peer, handler, msg, expect, timeout_s):
            return SimpleNamespace(signed=b"forged")

    node = SwarmNode.__new__(SwarmNode)
    node.bootstrap_transport = Transport()
    with caplog.at_level(logging.INFO), pytest.raises(ManifestRefused, match="signed by someone else"):
        asyncio.run(node.fetch_manifest(["peer"], accept=lambda signed: "signed by someone else"))
    assert any("is not taken" in r.getMessage() for r in caplog.records)  # kept for --verbose
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.records


@pytest.mark.parametrize("error,one_line", [
    (MemoryError(), True),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:127] data. DefaultCPUAllocator: can't allocate memory: you "
                  "tried to allocate 128000077304 bytes."), True),
    (RuntimeError("a real bug"), False),  # not a user's error: its traceback stays
])
def test_running_out_of_memory_is_one_line_that_names_the_sizes_to_lower(monkeypatch, error, one_line):
    from groundswell.peer import train_local

    def fails(*args, **kwargs):
        raise error

    monkeypatch.setattr(train_local, "run_train_local", fails)
    res = CliRunner().invoke(app, ["train-local", "--steps", "1"])
    if one_line:
        _one_error_line(res, "out of memory")
        assert "lower data.batch_size" in res.output
    else:
        assert res.exit_code == 1 and isinstance(res.exception, RuntimeError)


def test_the_codec_bench_out_of_memory_names_its_own_size_to_lower(monkeypatch):
    # Found by a review: `bench codecs --params 10**14` was told to lower data.batch_size.
    from groundswell.peer import bench_codecs

    def fails(*args, **kwargs):
        raise MemoryError()

    monkeypatch.setattr(bench_codecs, "run_codec_bench", fails)
    res = CliRunner().invoke(app, ["bench", "codecs", "--params", "1000"])
    _one_error_line(res, "out of memory (MemoryError); lower --params")
    assert "batch_size" not in res.output


def test_a_deliberate_exit_passes_the_out_of_memory_check_on_any_torch(monkeypatch):
    # typer's Exit is a RuntimeError; torch.OutOfMemoryError is new in torch 2.5 (review)
    import torch
    import typer
    from groundswell.peer import train_local

    def exits(*args, **kwargs):
        raise typer.Exit(3)

    monkeypatch.delattr(torch, "OutOfMemoryError", raising=False)
    monkeypatch.setattr(train_local, "run_train_local", exits)
    res = CliRunner().invoke(app, ["train-local", "--steps", "1"])
    assert res.exit_code == 3 and "out of memory" not in res.output and res.exception is None or \
        isinstance(res.exception, SystemExit)


def test_launch_refuses_a_volunteers_state_dir_before_reading_its_identity(tmp_path, nothing_starts):
    # Its identity.key would have become the coordinator's key, and the coordinator's exit
    # checkpoint would have replaced the volunteer's of the same round, unsent work and all.
    sd = tmp_path / "volunteer"
    sd.mkdir()
    (sd / "volunteer.json").write_text('{"peer_id": "x", "coordinator": "y", "run_id": "z"}\n')
    before = sorted(p.name for p in sd.iterdir())
    res = CliRunner().invoke(app, ["launch", str(EXAMPLE), "--state-dir", str(sd), "--quiet"])
    _one_error_line(res, "is a volunteer's state dir")
    assert sorted(p.name for p in sd.iterdir()) == before  # no identity.key, manifest or bootstrap line made


def test_launch_refuses_a_state_dir_with_no_readable_checkpoint_before_starting(tmp_path, nothing_starts):
    # It used to start the network, write the manifest and print the line volunteers paste, and
    # only then refuse (a new genesis would sign another round 0 under the run's volunteers).
    sd = tmp_path / "run"
    sd.mkdir()
    (sd / "checkpoint-00000003.pt").write_bytes(b"not a checkpoint")
    res = CliRunner().invoke(app, ["launch", str(EXAMPLE), "--state-dir", str(sd), "--quiet"])
    _one_error_line(res, "none of the checkpoints in")
    assert "volunteers join with" not in res.output
    assert not (sd / "manifest.signed").exists() and not (sd / "bootstrap.txt").exists()


def test_launch_refuses_a_state_dir_that_held_checkpoints_of_its_run_but_holds_none_now(tmp_path, nothing_starts):
    # It used to sign a new genesis without a word: a round 0 of another state under the run's
    # volunteers, who are all past it.
    from groundswell.peer.launch_checks import mark_genesis_saved

    sd = tmp_path / "run"
    sd.mkdir()
    mark_genesis_saved(sd)  # what the first launch left with its first checkpoint, deleted since
    res = CliRunner().invoke(app, ["launch", str(EXAMPLE), "--state-dir", str(sd), "--quiet"])
    _one_error_line(res, f"{sd} held checkpoints of this run (genesis.done) but holds none now")
    assert not (sd / "manifest.signed").exists() and not (sd / "bootstrap.txt").exists()


def test_the_cli_prints_ipv6_addresses_as_they_are():
    # rich reads ":ab:", ":cd:" or ":100:" in an IPv6 address as an emoji code: the line a
    # volunteer pastes came out as "2001:db8💯5::1" and was refused.
    from groundswell.peer import cli, status_view

    line = "groundswell join 'gs1:X@/ip6/2001:db8:100:5::1/tcp/4001' /ip6/fd00:ab:cd::7"
    for console in (cli.console, status_view.console):
        with console.capture() as captured:  # (the console's own stream is left alone)
            console.print(line, highlight=False, soft_wrap=True)
        assert captured.get().strip() == line


def test_the_coordinator_is_public_whatever_a_probe_would_say(tmp_path, nothing_starts, monkeypatch):
    # After a restart with --peer, volunteers ran the dial-back probe on it; a "private" answer made
    # its DHT a client and its daemon private while it still took aggregator and leader roles.
    from groundswell.peer.participant import Participant

    seen = []

    def capture(self, manifest, signed, ident, ident_path, opts, *args, **kwargs):
        seen.append(opts)
        raise KeyboardInterrupt  # enough: nothing else of the launch is under test

    monkeypatch.setattr(Participant, "__init__", capture)
    peer = _bootstrap().split("@", 1)[1]
    CliRunner().invoke(app, ["launch", str(EXAMPLE), "--state-dir", str(tmp_path / "sd"), "--quiet", "--peer", peer])
    assert len(seen) == 1 and seen[0].reachability == "public" and seen[0].serves


def test_join_refuses_a_dir_bound_to_another_peer_before_making_a_key_or_starting(tmp_path, nothing_starts):
    # It made a new identity.key there, started the network and fetched the manifest, and only
    # then refused the dir (bound to the peer whose key had been moved away).
    sd = tmp_path / "peer"
    sd.mkdir()
    (sd / "volunteer.json").write_text('{"peer_id": "12D3KooWX", "coordinator": "C", "run_id": "r"}\n')
    res = CliRunner().invoke(app, ["join", _bootstrap(), "--state-dir", str(sd)])
    _one_error_line(res, "holds the work of peer 12D3KooWX, but its identity.key is gone")
    assert not (sd / "identity.key").exists()
    Identity.generate().save(sd / "identity.key")  # another peer's key in its place
    res = CliRunner().invoke(app, ["join", _bootstrap(), "--state-dir", str(sd)])
    _one_error_line(res, "holds the work of peer 12D3KooWX, not of this identity")  # before the network starts


def test_join_refuses_a_coordinators_state_dir_before_reading_its_identity(tmp_path, nothing_starts):
    # The mirror of the test above: a join there trained, wrote its checkpoints among the
    # coordinator's (pruning them in time) and volunteer.json, and the coordinator could no
    # longer resume from its own dir.
    sd = tmp_path / "coordinator"
    sd.mkdir()
    (sd / "manifest.signed").write_bytes(b"signed manifest")
    before = sorted(p.name for p in sd.iterdir())
    res = CliRunner().invoke(app, ["join", _bootstrap(), "--state-dir", str(sd), "--quiet"])
    _one_error_line(res, "is a coordinator's state dir")
    assert sorted(p.name for p in sd.iterdir()) == before  # no identity.key or volunteer.json made


@pytest.mark.parametrize("section, key, value, words", [
    ("inner", "beta1", "1.0", "inner.beta1 must be in [0, 1)"),
    ("inner", "beta2", "1.0", "inner.beta2 must be in [0, 1)"),
    ("round", "slack_s", "0.0", "round.slack_s must be at least 0.5 s"),
    ("round", "deadline_s", "1e12", "round.deadline_s must be at most 86400 s"),
])
def test_launch_refuses_round_and_optimizer_values_that_could_never_work(tmp_path, nothing_starts, section, key,
                                                                          value, words):
    # Each passed validation: beta = 1 then failed every volunteer as it built AdamW (a traceback),
    # a zero slack timed out every request at once (no round could commit), a huge deadline
    # overflowed a timer.
    import tomllib

    text = EXAMPLE.read_text()
    assert f"[{section}]" in text
    lines = [line for line in text.splitlines() if not line.strip().startswith(f"{key} ")]
    at = lines.index(f"[{section}]")
    lines.insert(at + 1, f"{key} = {value}")
    bad = tmp_path / "run.toml"
    bad.write_text("\n".join(lines) + "\n")
    assert tomllib.loads(bad.read_text())[section][key] == float(value)  # the value reached the manifest
    res = CliRunner().invoke(app, ["launch", str(bad), "--state-dir", str(tmp_path / "sd"), "--quiet"])
    _one_error_line(res, words)


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_a_cuda_device_on_a_machine_without_one_is_named_as_given(monkeypatch, device):
    import torch
    from groundswell.peer.config import ConfigError, check_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=f"^--device {device} was asked for, but torch sees no CUDA device$"):
        check_device(device)


def test_a_volunteer_out_of_memory_is_not_told_to_change_the_runs_sizes(monkeypatch, tmp_path):
    # The manifest fixes the batch sizes and the model: a volunteer can only change its device
    # (found by a review of the device path).
    from groundswell.peer import cli_swarm

    def fails(*args, **kwargs):
        raise MemoryError()

    monkeypatch.setattr(cli_swarm, "check_device", fails)
    res = CliRunner().invoke(app, ["join", "gs1:x@/ip4/127.0.0.1/tcp/1/p2p/x", "--state-dir", str(tmp_path / "v")])
    _one_error_line(res, "out of memory (MemoryError); this run's model and batches need more memory")
    assert "batch_size" not in res.output and "--device cpu" in res.output


def test_a_gpu_torch_cannot_run_on_is_one_error_line(monkeypatch):
    # is_available() is true on a GPU the installed torch has no kernels for ("no kernel image is
    # available"), or one held by another process in exclusive mode: the first kernel failed
    # later, as a traceback (found by a review of the device path).
    import torch
    from groundswell.peer.config import ConfigError, check_device

    real_ones = torch.ones

    def ones(*args, device=None, **kwargs):
        if device is not None and torch.device(device).type == "cuda":
            raise RuntimeError("CUDA error: no kernel image is available for execution on the device\nmore")
        return real_ones(*args, device=device, **kwargs)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch, "ones", ones)
    with pytest.raises(ConfigError, match=r"^--device cuda: torch cannot run on it \(CUDA error: no kernel image is "
                                          r"available for execution on the device\); is it busy, or is this torch"):
        check_device("cuda")
    check_device("cuda", probe=False)  # a driver that only starts the peers: each of them probes its own


def test_train_local_out_where_it_cannot_write_is_refused_before_training(nothing_starts, tmp_path, monkeypatch):
    # Found by a review (2026-12-07): only the folder's existence was checked, so a read-only one
    # was found after the training, and its result was lost with one error line.
    import tempfile

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "TemporaryFile", read_only)
    res = CliRunner().invoke(app, ["train-local", "--out", str(tmp_path / "r.json")])
    _one_error_line(res, f"--out {tmp_path / 'r.json'}: cannot write in {tmp_path} (Read-only file system)")
    (tmp_path / "to-folder").symlink_to(tmp_path)  # a link to a folder: refused before training too
    res = CliRunner().invoke(app, ["train-local", "--out", str(tmp_path / "to-folder")])
    _one_error_line(res, "is a folder: give the path of a file to write")


def _umask() -> int:
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_train_local_prints_its_result_before_writing_it_and_writes_it_whole(tmp_path, monkeypatch):
    from groundswell.peer import train_local

    class Result:
        name, eval_loss, steps, workers, bytes_per_worker, bytes_vs_data_parallel = "single", 1.5, 2, 1, 0, 0.0
        wall_s, params_identical = 0.1, True

        def as_dict(self):
            return {"eval_loss": 1.5}

    monkeypatch.setattr(train_local, "run_train_local", lambda cfg, progress: Result())
    out = tmp_path / "r.json"
    res = CliRunner().invoke(app, ["train-local", "--algorithm", "single", "--out", str(out), "--json"])
    assert res.exit_code == 0 and '"eval_loss": 1.5' in res.output and out.read_text().startswith("{")

    assert oct(out.stat().st_mode & 0o777) == oct(0o666 & ~_umask())  # as the shell would make it
    link = tmp_path / "link.json"  # a link (or a pipe: `--out >(jq .)`) is written in place, not replaced
    link.symlink_to(out)
    res = CliRunner().invoke(app, ["train-local", "--algorithm", "single", "--out", str(link), "--json"])
    assert res.exit_code == 0 and link.is_symlink() and out.read_text().startswith("{")
    out.chmod(0o600)  # a private file replaced stays private
    res = CliRunner().invoke(app, ["train-local", "--algorithm", "single", "--out", str(out), "--json"])
    assert res.exit_code == 0 and oct(out.stat().st_mode & 0o777) == oct(0o600)
    log = tmp_path / "log.txt"  # /dev/fd/N (stdout redirected to a log): appended to, never replaced
    log.write_text("earlier lines\n")
    with open(log, "a") as appending:
        res = CliRunner().invoke(app, ["train-local", "--algorithm", "single", "--out",
                                       f"/dev/fd/{appending.fileno()}", "--json"])
    assert res.exit_code == 0 and log.read_text().startswith("earlier lines\n{")

    from groundswell.peer import state_files

    def disk_full(path, write, durable=False, mode=0o600):  # full since the start: printed all the same
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(state_files, "write_atomically", disk_full)
    res = CliRunner().invoke(app, ["train-local", "--algorithm", "single", "--out", str(out), "--json"])
    assert '"eval_loss": 1.5' in res.output and res.exit_code == 2
    assert "could not be written (No space left on device); the result is printed above" in res.output
