"""What `join`, `launch` and `status` must not do on their user's machine or on untrusted input.
A coordinator's signed manifest vouches for the run, not for paths on the volunteer's disk or code
to import, so `join` takes the dataset from `--data` and runs a `module:callable` model only with
`--allow-model-code`; records and manifests from peers are shown as text and checked one by one;
a run does not start on a first checkpoint that could not be written."""

from __future__ import annotations

import pytest
from groundswell.peer.config import ConfigError
from groundswell.peer.join_consent import volunteer_corpus
from groundswell.peer.manifest import manifest_from_mapping


def _manifest(source: str = "stdlib", spec: str = "tiny"):
    return manifest_from_mapping({"run": {"id": "consent", "open": True}, "model": {"spec": spec},
                                  "data": {"source": source}})


def _folder(path, text: str):
    path.mkdir()
    (path / "a.txt").write_text(text * 400)
    (path / "b.txt").write_text(text[::-1] * 400)
    return path


def test_a_run_on_its_own_dataset_trains_on_the_copy_the_volunteer_names(tmp_path):
    # The coordinator's path (here a folder of "private" files on this very machine) is never read.
    private = _folder(tmp_path / "private", "secret key material ")
    mine = _folder(tmp_path / "mine", "the run's published text ")
    with pytest.raises(ConfigError, match="--data"):
        volunteer_corpus(_manifest(str(private)), None, False)
    corpus = volunteer_corpus(_manifest(str(private)), mine, False)
    assert corpus.fingerprint == volunteer_corpus(_manifest(str(mine)), mine, False).fingerprint
    assert corpus.fingerprint != volunteer_corpus(_manifest(str(private)), private, False).fingerprint
    with pytest.raises(ConfigError, match="--data .*does not exist"):
        volunteer_corpus(_manifest(str(private)), tmp_path / "missing", False)


def test_a_copy_of_the_dataset_that_is_not_the_coordinators_is_refused(tmp_path, caplog):
    # launch puts its copy's fingerprint (files and sizes) in the signed manifest: a partial, newer
    # or other copy would train the volunteer on other data, silently (text corpora all have the
    # same vocabulary, so the model checks could never tell)
    from groundswell.peer.launch_checks import prepare_manifest as _check_model_and_data

    theirs = _folder(tmp_path / "theirs", "the run's published text ")
    filled, corpus, _ = _check_model_and_data(_manifest(str(theirs)), tmp_path / "run.toml")
    assert filled.data.fingerprint == corpus.fingerprint
    same = _folder(tmp_path / "same", "the run's published text ")
    assert volunteer_corpus(filled, same, False).fingerprint == corpus.fingerprint
    partial = _folder(tmp_path / "partial", "the run's published text ")
    (partial / "b.txt").unlink()
    with pytest.raises(ConfigError, match="--data .*partial is not the run's dataset"):
        volunteer_corpus(filled, partial, False)
    (theirs / "c.txt").write_text("a file added since the manifest said which")
    with pytest.raises(ConfigError, match="data.fingerprint is .* changed"):
        _check_model_and_data(filled, tmp_path / "run.toml")
    # the standard library differs with every Python build: not fingerprinted (a patch upgrade of
    # the coordinator's Python would refuse the run's own resume); one that says so only warns
    stdlib, _, _ = _check_model_and_data(_manifest(), tmp_path / "run.toml")
    assert stdlib.data.fingerprint == ""
    import dataclasses

    other = dataclasses.replace(stdlib, data=dataclasses.replace(stdlib.data, fingerprint="0" * 16))
    assert volunteer_corpus(other, None, False).name and "not the coordinator's" in caplog.text
    with pytest.raises(ConfigError, match="lowercase hex"):
        _manifest_with_fingerprint("not hex!")


def _manifest_with_fingerprint(fingerprint: str):
    return manifest_from_mapping({"run": {"id": "consent", "open": True}, "data": {"fingerprint": fingerprint}})


def test_a_stdlib_run_needs_no_data_and_refuses_other_data(tmp_path):
    assert volunteer_corpus(_manifest(), None, False).name
    with pytest.raises(ConfigError, match="leave --data out"):
        volunteer_corpus(_manifest(), _folder(tmp_path / "mine", "text "), False)


def test_a_model_the_manifest_names_as_code_runs_only_with_consent():
    manifest = _manifest(spec="custom_model_example:make_model")
    with pytest.raises(ConfigError, match="--allow-model-code"):
        volunteer_corpus(manifest, None, False)
    assert volunteer_corpus(manifest, None, True).name
    # a module not installed here is said before anything else happens (a review saw "joined" first)
    with pytest.raises(ConfigError, match="cannot import module 'not_installed_here'"):
        volunteer_corpus(_manifest(spec="not_installed_here:make_model"), None, True)


def test_a_model_that_builds_another_parameter_layout_than_the_coordinators_is_refused(tmp_path, monkeypatch):
    # peers exchange one flat vector: a volunteer's build with the same count but another order
    # (another version of the code, layers registered from a set) would train other coordinates
    # than everyone's, and every parameter hash would still agree
    import dataclasses

    import custom_model_example as example
    from groundswell.peer.launch_checks import prepare_manifest
    from groundswell.peer.workload import build_workload, check_layout, parameter_layout

    spec = "custom_model_example:registered_in_varying_order"
    signed, corpus, built = prepare_manifest(_manifest(spec=spec), tmp_path / "run.toml")
    assert signed.model.layout == parameter_layout(built.model) and len(signed.model.layout) == 32
    check_layout(signed, build_workload(spec, corpus.vocab_size, 7))  # the same build, other weights: fine
    import torch

    wrapped = torch.nn.DataParallel(built.model)  # (as torch.compile's `_orig_mod.`: the same parameters)
    assert parameter_layout(wrapped) == signed.model.layout != parameter_layout(torch.nn.Sequential(built.model))
    monkeypatch.setattr(example, "LAYER_ORDER", ("out", "hidden"))
    other = build_workload(spec, corpus.vocab_size, signed.run.seed)
    assert sum(p.numel() for p in other.model.parameters()) == sum(p.numel() for p in built.model.parameters())
    with pytest.raises(ConfigError, match="another parameter layout than the coordinator's"):
        check_layout(signed, other)
    check_layout(_manifest(spec=spec), other)  # a manifest made by hand says none: nothing to check
    from groundswell.peer.manifest import sign_manifest
    from groundswell.peer.participant import Participant
    from groundswell.peer.swarm import NodeOptions
    from groundswell.protocol.identity import Identity

    me = Identity.generate()
    me.save(tmp_path / "id.key")
    with pytest.raises(ConfigError, match="another parameter layout"):  # a joiner's, before any download
        Participant(signed, sign_manifest(signed, me).to_bytes(), me, str(tmp_path / "id.key"), NodeOptions(),
                    tmp_path / "state", corpus=corpus)
    with pytest.raises(ConfigError, match="model.layout is .* changed"):  # the coordinator's own code changed
        prepare_manifest(signed, tmp_path / "run.toml")
    with pytest.raises(ConfigError, match="model.layout must be lowercase hex"):
        dataclasses.replace(signed.model, layout="not hex!")


def test_status_shows_what_peers_publish_as_text_not_markup(capsys):
    """Every string in a record is its peer's own word (in an open run, anyone's): one role of
    "[/x]" made `status` die with a rich MarkupError for everyone looking at the run."""
    from groundswell.peer.status_view import print_status

    hostile = {"peer": "12D3KooW[/x]", "role": "[/x]", "round": 3, "params_hash": "[bold]abc", "trains": True,
               "serves": True, "reachability": "[/]", "hole_punched": [], "loss": None, "bytes_sent": 0,
               "refused_messages": 0, "banning": ["[/red]"], "scores": ["[/y]=+0.1"], "age_s": 1.0}
    print_status("run[/z]", [hostile])
    out = capsys.readouterr().out  # on stdout, as --json's is: `status ... > file` keeps it (README check)
    assert "[/x]" in out and "[/red]" in out and "[bold]abc"[:8] in out


def test_status_shows_no_control_characters_no_false_coordinator_and_bounded_output(capsys):
    # Found by a review: an escape sequence in a record reached the terminal (a role of
    # "\x1b[2J" clears it), any peer claiming the coordinator's role was shown as "coord", a list
    # of bans squeezed every column, and a thousand fake records printed a thousand rows.
    from groundswell.peer import status_view

    coordinator = "12D3KooW" + "x" * 30 + "TheCoord01"

    def row(peer: str, role: str, **kw) -> dict:
        return {"peer": peer, "role": role, "round": 7, "params_hash": "abcdef0123", "trains": True, "serves": True,
                "reachability": "public", "hole_punched": [], "loss": None, "loss_round": None, "bytes_sent": 0,
                "refused_messages": 0, "banning": [], "scores": [], "age_s": 1.0, **kw}

    rows = [row("12D3KooWimpostor", "coordinator", params_hash="\x1b[2J\x1b[H0")]
    rows += [row(f"12D3KooWfake{i:04d}", "volunteer") for i in range(status_view.MAX_ROWS + 5)]
    rows += [row(coordinator, "coordinator", loss=2.5, loss_round=6, banning=["12D3KooWa" * 4, "12D3KooWb" * 4])]
    status_view.print_status("r", rows, coordinator)
    out = capsys.readouterr().out
    assert "\x1b" not in out and "?[2J" in out
    lines = out.splitlines()
    first = next(i for i, line in enumerate(lines) if "TheCoord01" in line)
    assert first == min(i for i, line in enumerate(lines) if "fake" in line or "TheCoord01" in line)  # first
    assert " coord " in lines[first] and "2.5000@6" in lines[first] and " 2 " in lines[first]
    assert "... and 7 more peers (--json lists them all)" in out
    # the impostor is no coordinator: counted with the volunteers, as the coordinator's table counts them
    assert f"{len(rows)} peers online ({len(rows) - 1} besides the coordinator)" in out
    status_view.print_status("r", [rows[0]], coordinator)
    assert "coord?" in capsys.readouterr().out


def test_status_marks_differing_hashes_at_one_round_and_bounds_the_score_lines(capsys):
    # Found by a review (2026-12-07): hashes cut to 8 characters made deadbeef000... and
    # deadbeef111... look the same (and anyone can publish a prefix), and crafted records' score
    # lists printed 6,375 lines.
    from groundswell.peer import status_view

    def row(peer: str, params_hash: str, round_id: int = 7, **kw) -> dict:
        return {"peer": peer, "role": "volunteer", "round": round_id, "params_hash": params_hash, "trains": True,
                "serves": True, "reachability": "public", "hole_punched": [], "loss": None, "loss_round": None,
                "bytes_sent": 0, "refused_messages": 0, "banning": [], "scores": [], "age_s": 1.0, **kw}

    status_view.print_status("r", [row("12D3KooWaaaa", "deadbeef000"), row("12D3KooWbbbb", "deadbeef111"),
                                   row("12D3KooWcccc", "0123456789", round_id=8)])
    out = capsys.readouterr().out
    assert out.count("deadbeef!") == 2 and "01234567!" not in out and "01234567" in out
    scores = [f"12D3KooWvictim{i:04d}=+0.{i}" for i in range(64)]
    status_view.print_status("r", [row(f"12D3KooWlead{i:04d}", "h", scores=scores) for i in range(50)])
    out = capsys.readouterr().out
    assert out.count("scores by") == status_view.MAX_SCORERS + 1 and "and 48 more" in out
    assert len(out.splitlines()) < 200


def test_one_records_huge_numbers_do_not_push_the_other_columns_off_the_table(capsys):
    # Found by a review: a loss of 1e308 (finite, so the schema takes it) printed as 314 digits in
    # a column that never wraps, and every column after "params" vanished, for every row.
    from groundswell.peer import status_view

    def row(peer: str, **kw) -> dict:
        return {"peer": peer, "role": "volunteer", "round": 7, "params_hash": "abcdef0123", "trains": True,
                "serves": True, "reachability": "public", "hole_punched": [], "loss": 2.5, "loss_round": 6,
                "bytes_sent": 0, "refused_messages": 0, "banning": [], "scores": [], "age_s": 1.0, **kw}

    status_view.print_status("r", [row("12D3KooWhonest0001"),
                                   row("12D3KooWhostile001", loss=-1e308, round=2**40, loss_round=2**40,
                                       bytes_sent=2**62, refused_messages=2**62)])
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("peer")).split()
    assert header[:9] == ["peer", "role", "reach", "round", "params", "loss@round", "sent", "ref", "bans"]
    honest = next(line for line in out.splitlines() if "honest0001" in line).split()
    assert honest[2:] == ["pub", "7", "abcdef01", "2.5000@6", "0.0MB", "0", "-", "1s"]
    hostile = next(line for line in out.splitlines() if "hostile001" in line).split()
    assert hostile[2:] == ["pub", "1e+12", "abcdef01", "-1e+308@1e+12", "5e+18B", "5e+18", "-", "1s"]
    assert status_view._bytes(12_345_678_901) == "12345.7MB" and status_view._bytes(123 * 10**12) == "1e+14B"


def test_a_bootstrap_peer_serving_a_manifest_that_does_not_verify_does_not_stop_the_others():
    """A bootstrap line may list several peers; one of them serving another run's manifest (a
    stale address) or a forged one used to end the join there."""
    import asyncio
    from types import SimpleNamespace

    from groundswell.peer.swarm import ManifestRefused, SwarmNode

    served = {"stale": b"another run's", "good": b"ours"}
    asked: list[str] = []

    class Transport:
        async def request(self, peer, handler, msg, expect, timeout_s):
            asked.append(peer)
            return SimpleNamespace(signed=served[peer])

    node = SwarmNode.__new__(SwarmNode)
    node.bootstrap_transport = Transport()

    def accept(signed: bytes) -> str | None:
        return None if signed == b"ours" else "signed by someone else"

    assert asyncio.run(node.fetch_manifest(["stale", "good", "stale"], accept=accept)) == b"ours"
    assert asked == ["stale", "good"]  # each peer once per try
    served["good"] = b"forged"
    asked.clear()
    with pytest.raises(ManifestRefused, match="signed by someone else"):  # join says so in one line
        asyncio.run(node.fetch_manifest(["stale", "good"], accept=accept))
    assert asked == ["stale", "good"]  # a peer whose manifest was refused is not asked again


def test_a_coordinator_whose_first_checkpoint_cannot_be_written_does_not_start_the_run(tmp_path):
    """A restart without it would sign another genesis (its own time): round 0 of another state
    than the one volunteers who joined meanwhile hold. It used to carry on, the failure logged."""
    from types import SimpleNamespace

    from groundswell.peer.coordinator_role import run_coordinator
    from groundswell.peer.stop_flag import StopFlag
    from groundswell.protocol.identity import Identity

    followed: list[str] = []
    p = SimpleNamespace(
        manifest=SimpleNamespace(run=SimpleNamespace(id="r")), identity=Identity.generate(), state_dir=tmp_path,
        start_network=lambda: None, events=SimpleNamespace(write=lambda *a, **k: None),
        node=SimpleNamespace(startup_s={}, maddrs=[], record_decision=lambda d, supersede=False: None,
                             interrupt_calls_on=lambda e: followed.append("followed")),
        load_checkpoint=lambda: None, snapshot=lambda: followed.append("published"),
        save_checkpoint=lambda *a, **k: None)
    with pytest.raises(OSError, match="first checkpoint could not be written"):
        run_coordinator(p, stop=StopFlag())
    assert followed == []  # no round was followed, and the genesis it could not save was never served
    # unmarked: the launch after freeing space is not refused as a run whose checkpoints are gone
    assert not (tmp_path / "genesis.done").exists()


def test_a_peer_with_no_manifest_yet_is_asked_again_and_a_fallback_takes_only_the_bound_launch():
    """Entering through the run's proven peers (its bootstrap peers down): a volunteer restarting
    too has no manifest yet (it used to count as a refusal, and two volunteers restarting together
    both gave up), and any contributor is one of them: one serving an older launch's manifest,
    validly signed, must not stop the others from being asked."""
    import asyncio
    from types import SimpleNamespace

    from groundswell.peer.join_network import fetch_manifest, manifest_digest
    from groundswell.peer.manifest import manifest_from_mapping, sign_manifest
    from groundswell.peer.swarm import SwarmNode
    from groundswell.protocol.identity import Identity

    coordinator = Identity.generate()
    old, new = (sign_manifest(manifest_from_mapping({"run": {"id": "r", "open": True, "seed": seed}}),
                              coordinator).to_bytes() for seed in (1, 2))
    served = {"old": [old], "restarting": [b"", new]}  # one answer per ask, the last for good
    asked: list[str] = []

    class Transport:
        async def request(self, peer, handler, msg, expect, timeout_s):
            asked.append(peer)
            answers = served[peer]
            return SimpleNamespace(signed=answers.pop(0) if len(answers) > 1 else answers[0])

    node = SwarmNode.__new__(SwarmNode)
    node.bootstrap_transport = Transport()
    node.entered_through = ["old", "restarting"]
    node.call = lambda coro, timeout_s=None: asyncio.run(coro)
    signed, manifest = fetch_manifest(node, [], coordinator.peer_id, launch=manifest_digest(new))
    assert signed == new and manifest.run.seed == 2
    assert asked == ["old", "restarting", "restarting"]  # the older launch's refused; none yet: asked again
    node.entered_through = []  # from the bootstrap peers, the coordinator's own: any launch it serves
    served["old"] = [old]
    assert fetch_manifest(node, ["/ip4/127.0.0.1/tcp/1/p2p/old"], coordinator.peer_id,
                          launch=manifest_digest(new))[0] == old
