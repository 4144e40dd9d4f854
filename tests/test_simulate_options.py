"""`simulate`'s options as the manifest it would launch: checked in-process, nothing is started."""

from __future__ import annotations

import math
import tomllib

import pytest
from groundswell.peer import simulate
from groundswell.peer.cli import app
from groundswell.peer.config import ConfigError
from groundswell.peer.manifest import manifest_from_mapping
from groundswell.peer.simulate import SimulateOptions, check_manifest, manifest_toml
from typer.testing import CliRunner


@pytest.mark.parametrize("options, words", [
    ({"error_decay": -0.5}, "--error-decay must be in [0, 1], got -0.5"),
    ({"error_decay": math.nan}, "--error-decay must be a finite number, got nan"),
    ({"warmup_steps": -7}, "--warmup must be >= 0, got -7"),
    ({"topk": 0}, "--topk must be at least 1, got 0"),  # ran silently with 64
    ({"topk": -3}, "--topk must be at least 1, got -3"),
    ({"timeout_s": 0.0}, "--timeout must be a finite number of seconds > 0, got 0.0"),
])
def test_an_out_of_range_option_is_refused_not_replaced_by_the_default(options, words):
    # a value below zero used to mean "the default": -0.5, nan or -7 ran silently with 0.95 or min(50, 2 H)
    with pytest.raises(ConfigError) as info:
        check_manifest(SimulateOptions(**options))
    assert str(info.value) == words


@pytest.mark.parametrize("inner_steps, warmup", [(20, 40), (30, 50)])
def test_none_is_the_default_and_a_given_value_is_kept(inner_steps, warmup):
    opts = SimulateOptions(inner_steps=inner_steps, error_decay=None, warmup_steps=None)
    check_manifest(opts)
    manifest = manifest_from_mapping(tomllib.loads(manifest_toml(opts)))
    assert manifest.outer.error_decay == 0.95 and manifest.inner.warmup_steps == warmup
    assert manifest.outer.topk == 64
    given = SimulateOptions(inner_steps=inner_steps, error_decay=0.0, warmup_steps=0, topk=32)
    manifest = manifest_from_mapping(tomllib.loads(manifest_toml(given)))
    assert manifest.outer.error_decay == 0.0 and manifest.inner.warmup_steps == 0 and manifest.outer.topk == 32


@pytest.mark.parametrize("args, words", [
    # late joiners start once round 2 is applied, while a round is still to go: never with 3 rounds
    (["--late-joiners", "1", "--rounds", "3"], "--late-joiners start once round 2 is applied, and not in the last round: they need --rounds 5"),
    # a review found 4 accepted, and its late joiners never started (not in the last round)
    (["--late-joiners", "1", "--rounds", "4"], "they need --rounds 5 or more, got --rounds 4"),
    # with no more peers than min_peers no fault ever finds a victim: the run would exit 0 without any
    (["--peers", "2", "--kill-every", "10"], "--kill-every needs more peers than --min-peers (2): with --peers 2"),
    (["--peers", "3", "--min-peers", "3", "--freeze-every", "10"], "--freeze-every needs more peers than --min-peers (3)"),
    (["--peers", "1", "--leave-every", "10"], "--leave-every needs more peers than --min-peers (1)"),
    # a review found faults accepted with 1 or 2 rounds (a "never happened" warning, exit 0)
    (["--peers", "3", "--rounds", "2", "--kill-every", "1"], "--kill-every needs --rounds 3 or more"),
    (["--peers", "3", "--rounds", "1", "--freeze-every", "1"], "--freeze-every needs --rounds 3 or more"),
    (["--peers", "3", "--rounds", "2", "--kill-coordinator-at", "5"], "--kill-coordinator-at needs --rounds 3 or more"),
])
def test_faults_that_could_never_happen_are_refused_before_any_process_starts(tmp_path, monkeypatch, args, words):
    def no_run(*args, **kwargs):
        raise AssertionError("the simulation started")

    monkeypatch.setattr(simulate, "run_simulation", no_run)
    # one more peer than --min-peers, and 5 rounds, are enough
    SimulateOptions(peers=3, min_peers=2, kill_every=10, freeze_every=10, leave_every=10, late_joiners=1, rounds=5)
    res = CliRunner().invoke(app, ["simulate", *args, "--out", str(tmp_path / "sim")])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert words in " ".join(res.output.split()), res.output
    assert not (tmp_path / "sim").exists()

