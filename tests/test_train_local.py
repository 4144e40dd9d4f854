"""`train-local` end to end (fast), the config tree's strictness, and the CLI's error path."""

from __future__ import annotations

import json

import pytest
from groundswell.peer import mini_table
from groundswell.peer import train_local as train_local_module
from groundswell.peer.cli import _load_config, app
from groundswell.peer.config import (
    ConfigError,
    DataSection,
    EvalSection,
    InnerSection,
    ModelSection,
    OuterSection,
    TrainLocalConfig,
    from_mapping,
    replace_path,
)
from groundswell.peer.train_local import dense_ring_bytes, run_train_local
from typer.testing import CliRunner


def _cfg(algorithm: str, codec: str = "", workers: int = 2, steps: int = 40, h: int = 10) -> TrainLocalConfig:
    return TrainLocalConfig(
        workers=workers, steps=steps, seed=1,
        model=ModelSection("tiny"), data=DataSection(batch_size=8),
        inner=InnerSection(lr=3e-3, warmup_steps=5),
        outer=OuterSection(algorithm=algorithm, inner_steps=h, codec=codec),  # type: ignore[arg-type]
        eval=EvalSection(batches=2, batch_size=8),
    )


@pytest.mark.parametrize("algorithm,codec", [("diloco", "int8"), ("sparseloco", "")])
def test_train_local_loss_drops_and_replicas_agree(corpus, algorithm, codec):
    result = run_train_local(_cfg(algorithm, codec), corpus=corpus)
    first, last = result.eval_curve[0][1], result.eval_curve[-1][1]
    assert last < first - 0.05, result.eval_curve
    assert result.eval_loss < 5.0  # byte-level uniform guessing is ln(256) = 5.55
    assert result.params_identical
    assert len(result.eval_curve) == 4
    assert 0 < result.bytes_per_worker < result.steps * dense_ring_bytes(2, result.params)


def test_replicas_start_alike_whatever_seeds_the_models_weights(corpus, monkeypatch):
    # Found by a review (2026-12-07): each worker built its own model, so one initialised from a
    # generator train-local does not seed started elsewhere and never agreed.
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    cfg = replace_path(_cfg("diloco", steps=4, h=2), "model.spec", "custom_model_example:seeded_elsewhere")
    assert run_train_local(cfg, corpus=corpus).params_identical


def test_train_local_baselines_account_bytes(corpus):
    dp = run_train_local(_cfg("data-parallel", steps=10), corpus=corpus)
    assert dp.bytes_per_worker == 10 * dense_ring_bytes(2, dp.params)
    assert dp.bytes_vs_data_parallel == 1.0
    single = run_train_local(_cfg("single", workers=1, steps=10), corpus=corpus)
    assert single.bytes_per_worker == 0 and single.tokens_per_worker == 10 * 8 * 128


def test_config_rejects_unknown_keys_and_bad_values():
    cfg = from_mapping(TrainLocalConfig, {"workers": 3, "outer": {"algorithm": "sparseloco", "lr": 2}})
    assert cfg.outer.lr == 2.0 and cfg.outer.codec_name == "sparseloco" and cfg.workers == 3
    with pytest.raises(ConfigError, match="outer.lrr"):
        from_mapping(TrainLocalConfig, {"outer": {"lrr": 1.0}})
    with pytest.raises(ConfigError, match="workers"):
        from_mapping(TrainLocalConfig, {"workers": "four"})
    with pytest.raises(ConfigError, match="algorithm"):
        from_mapping(TrainLocalConfig, {"outer": {"algorithm": "adam"}})
    with pytest.raises(ConfigError, match="codec"):
        from_mapping(TrainLocalConfig, {"outer": {"codec": "zip"}})
    with pytest.raises(ConfigError, match=r"^outer\.inner_steps must be positive"):
        replace_path(TrainLocalConfig(), "outer.inner_steps", 0)
    assert replace_path(TrainLocalConfig(), "inner.lr", 1).inner.lr == 1.0


def test_cli_train_local_json_and_user_error(tmp_path):
    runner = CliRunner()
    out = tmp_path / "r.json"
    res = runner.invoke(app, ["train-local", "--workers", "2", "--steps", "4", "-H", "2", "--set", "data.batch_size=2",
                              "--set", "eval.batches=1", "--codec", "fp16", "--out", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["codec"] == "fp16" and data["steps"] == 4 and data["params_identical"]
    bad = runner.invoke(app, ["train-local", "--set", "outer.nope=1"])
    assert bad.exit_code == 2 and "unknown key" in bad.output and "Traceback" not in bad.output
    missing = runner.invoke(app, ["train-local", "--data", str(tmp_path / "absent")])
    assert missing.exit_code == 2 and "Traceback" not in missing.output


@pytest.mark.parametrize("algorithm,codec", [("diloco", "int8"), ("sparseloco", "")])
def test_train_local_with_overlap_learns_and_ends_agreed(corpus, algorithm, codec):
    # The delayed outer step costs some quality early on (measured here at 200 steps: +4% DiLoCo,
    # +5% SparseLoCo held-out loss); this checks it learns, ends agreed, and is really delayed.
    cfg = replace_path(_cfg(algorithm, codec, steps=120), "outer.overlap", 1)
    overlapped = run_train_local(cfg, corpus=corpus)
    blocking = run_train_local(_cfg(algorithm, codec, steps=120), corpus=corpus)
    first, last = overlapped.eval_curve[0][1], overlapped.eval_curve[-1][1]
    assert last < first - 0.3, overlapped.eval_curve
    assert overlapped.params_identical  # the last round is collected before the end
    assert overlapped.eval_loss < blocking.eval_loss * 1.25, (overlapped.eval_loss, blocking.eval_loss)
    assert overlapped.eval_curve != blocking.eval_curve  # the delay really changed the run


@pytest.mark.parametrize("mapping, words", [
    ({"outer": {"inner_steps": 0}}, "outer.inner_steps must be positive, got 0"),
    ({"eval": {"batches": 0}}, "eval.batches must be positive, got 0"),
    ({"data": {"batch_size": -1}}, "data.batch_size must be positive, got -1"),
    ({"inner": {"lr": 0}}, "inner.lr must be positive, got 0.0"),
])
def test_a_value_that_must_be_positive_is_named_by_its_dotted_key(mapping, words):
    # "inner_steps must be positive" alone does not say which section to fix
    with pytest.raises(ConfigError) as info:
        from_mapping(TrainLocalConfig, mapping)
    assert str(info.value) == words


def test_cli_train_local_single_trains_one_worker_without_a_workers_flag():
    # --help lists `single`; it used to be refused because workers (4) was checked before it became 1
    res = CliRunner().invoke(app, ["train-local", "--algorithm", "single", "--steps", "1", "--set", "eval.batches=1",
                                   "--set", "data.batch_size=2", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["workers"] == 1 and data["steps"] == 1


def test_train_local_config_is_checked_once_all_overrides_are_in(tmp_path):
    # Checked after each override, these were refused for a value a later override replaces.
    config = tmp_path / "run.toml"
    config.write_text('[outer]\nalgorithm = "sparseloco"\ncodec = "sparseloco"\n')
    cfg = _load_config(config, {"outer.algorithm": "diloco", "outer.codec": "fp32"}, [])
    assert (cfg.outer.algorithm, cfg.outer.codec) == ("diloco", "fp32")
    cfg = _load_config(None, {}, ["outer.codec=sparseloco", "outer.algorithm=sparseloco"])
    assert (cfg.outer.algorithm, cfg.outer.codec_name) == ("sparseloco", "sparseloco")
    assert _load_config(None, {"outer.algorithm": "single"}, []).workers == 1
    assert _load_config(None, {}, ["outer.algorithm=single"]).workers == 1
    # later overrides win; a whole table, then one of its keys
    cfg = _load_config(config, {"outer.lr": 2.0}, ["outer.lr=3", "outer={momentum = 0.5}", "outer.topk=32"])
    assert (cfg.outer.lr, cfg.outer.momentum, cfg.outer.topk, cfg.outer.algorithm) == (0.0, 0.5, 32, "diloco")
    # workers given explicitly is kept, and refused with single
    with pytest.raises(ConfigError, match="set workers = 1"):
        _load_config(None, {"workers": 3, "outer.algorithm": "single"}, [])
    with pytest.raises(ConfigError, match="unknown key 'outer.nope'"):
        _load_config(config, {}, ["outer.nope=1"])


def test_a_float_key_refuses_an_integer_too_large_for_a_float():
    with pytest.raises(ConfigError, match="^lr is out of range"):
        from_mapping(InnerSection, {"lr": 10**400})
    with pytest.raises(ConfigError, match="^outer.lr is out of range"):
        from_mapping(TrainLocalConfig, {"outer": {"lr": 10**400}})


@pytest.mark.parametrize("item, key", [
    ("outer.lr=nan", "outer.lr"), ("inner.lr=inf", "inner.lr"), ("inner.grad_clip=nan", "inner.grad_clip"),
    ("inner.weight_decay=inf", "inner.weight_decay"), ("outer.momentum=-nan", "outer.momentum"),
])
def test_a_float_key_refuses_nan_and_infinity(item, key):
    # a NaN outer learning rate passed every range check (NaN compares false) and ruined the run
    with pytest.raises(ConfigError, match=f"^{key} must be a finite number"):
        _load_config(None, {}, [item])


def test_cli_train_local_a_huge_number_is_one_error_line():
    res = CliRunner().invoke(app, ["train-local", "--set", "outer.lr=1" + "0" * 400])
    assert res.exit_code == 2 and "outer.lr is out of range" in res.output, res.output
    assert "Traceback" not in res.output


def test_cli_train_local_table_refuses_jobs_below_one():
    res = CliRunner().invoke(app, ["train-local", "--table", "--jobs", "0"])
    assert res.exit_code == 2 and "--jobs must be at least 1" in res.output, res.output
    assert "Traceback" not in res.output


@pytest.mark.parametrize("where, words", [
    ("missing/r.json", "missing does not exist"),
    ("file.txt/r.json", "file.txt is not a folder"),
    ("", "is a folder"),
])
@pytest.mark.parametrize("table", [False, True])
def test_cli_train_local_checks_out_before_training(tmp_path, monkeypatch, where, words, table):
    # a typo in --out's folder used to be found only when the result was written, after training
    def no_training(*args, **kwargs):
        raise AssertionError("trained before --out was checked")

    monkeypatch.setattr(train_local_module, "run_train_local", no_training)
    monkeypatch.setattr(mini_table, "run_mini_table", no_training)  # its rows train in other processes
    (tmp_path / "file.txt").write_text("")
    out = tmp_path / where
    res = CliRunner().invoke(app, ["train-local", *(["--table"] if table else ["--steps", "1"]), "--out", str(out)])
    assert res.exit_code == 2, res.output
    assert f"--out {out}" in " ".join(res.output.split()) and words in res.output, res.output
    assert "Traceback" not in res.output


def _fake_table_run(cfg):
    """A table row's run without training: the learning rate at 3x (and 1-worker's at 0.5x)
    diverges; the others score best at 2x."""
    base = mini_table.swept_lr(mini_table.row_config(cfg.name, mini_table.QUICK, cfg.steps))
    mult = round(mini_table.swept_lr(cfg) / base, 3)
    if mult == 3.0 or (cfg.name == "1-worker" and mult == 0.5):
        raise FloatingPointError("training diverged at step 7: loss is nan")
    return {"name": cfg.name, "swept_lr": mini_table.swept_lr(cfg), "eval_loss": 2.0 + abs(mult - 2.0),
            "steps": cfg.steps, "bytes_per_worker": 1 if cfg.name != "1-worker" else 0, "tokens_per_worker": 1,
            "params_identical": True, "wall_s": 0.0, "params": 10}


def test_a_sweep_point_that_diverges_is_ranked_last_not_the_end_of_the_table(monkeypatch):
    # The sweep tries up to 3x each row's learning rate; one that blew up (FloatingPointError from
    # the worker) ended the whole table, every other result lost. (With --jobs 1, the default, the
    # pool broke before any row: its processes were given 0 torch threads.)
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(mini_table, "_run", _fake_table_run)
    # threads stand in for the pool's processes (a forkserver or spawn child would not see the
    # patch); its initializer runs as in a process, where --jobs 1's broke the pool
    monkeypatch.setattr(mini_table, "ProcessPoolExecutor", ThreadPoolExecutor)
    result = mini_table.run_mini_table(jobs=1, quick=True, progress=lambda msg: None)
    diverged = [s for s in result["sweep"] if s["eval_loss"] is None]
    assert len(diverged) == len(mini_table.ROW_NAMES) + 1
    base = {r["name"]: mini_table.swept_lr(mini_table.row_config(r["name"], mini_table.QUICK, 1)) for r in result["rows"]}
    assert all(r["lr"] == pytest.approx(2 * base[r["name"]]) for r in result["rows"])  # the best that did not diverge
    json.dumps(result, allow_nan=False)  # strict JSON: a diverged point has no loss, not NaN
