"""peer/plots.py: a loss plot of a fake simulate report is a valid PNG."""

from __future__ import annotations

import sys

import pytest
from groundswell.peer import plots

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _report(with_times: bool = True) -> dict:
    losses = [5.6, 5.1, 4.8, None, 4.5, 4.3, 4.2, 4.1]
    report = {
        "peers": 4, "algorithm": "diloco", "codec": "fp32", "rounds_completed": len(losses),
        "eval_loss_by_round": losses,
        "events": [
            {"t": 0.1, "kind": "spawn", "peer": "peer-0"},  # not a fault: not drawn by default
            {"t": 7.5, "kind": "kill", "peer": "peer-1"},
            {"t": 12.0, "kind": "freeze", "peer": "peer-2"},
            {"t": 18.0, "kind": "thaw", "peer": "peer-2"},
            {"t": 21.0, "kind": "restart", "peer": "peer-1"},
            {"t": 25.0, "kind": "kill-coordinator", "peer": "coordinator"},
            {"t": 30.0, "kind": "join", "peer": "peer-4"},
            {"t": 33.0, "kind": "leave", "peer": "peer-3"},
            {"t": 60.0, "kind": "custom-fault", "peer": "peer-0"},
        ],
    }
    if with_times:
        report["round_end_t"] = [5.0 * (i + 1) for i in range(len(losses))]
    return report


def _is_png(path) -> bool:
    return path.exists() and path.stat().st_size > len(PNG_SIGNATURE) and path.read_bytes()[:8] == PNG_SIGNATURE


def test_plot_loss_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "loss.png"
    plots.plot_loss(_report(), out)
    assert _is_png(out)


def test_plot_loss_without_round_times_and_custom_kinds(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "sub" / "loss.png"
    plots.plot_loss(_report(with_times=False), out)
    assert _is_png(out)
    out2 = tmp_path / "all.png"
    plots.plot_loss(_report(), out2, kinds={"kill", "custom-fault", "spawn"}, title="custom")
    assert _is_png(out2)


def test_plot_loss_empty_report(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "empty.png"
    plots.plot_loss({"eval_loss_by_round": [], "events": []}, out)
    assert _is_png(out)


def test_round_position_places_events_between_rounds():
    ends = [10.0, 20.0, 30.0]
    assert plots._round_position(5.0, ends) == pytest.approx(-0.5)  # during round 0
    assert plots._round_position(15.0, ends) == pytest.approx(0.5)  # during round 1
    assert plots._round_position(30.0, ends) == pytest.approx(2.0)
    assert plots._round_position(35.0, ends) == pytest.approx(2.5)  # after the last round: extrapolated


def test_missing_matplotlib_raises_clear_import_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    with pytest.raises(ImportError, match="matplotlib"):
        plots.plot_loss(_report(), tmp_path / "x.png")
