"""Plots of a simulation report (`report.json` from `groundswell simulate`).

matplotlib is an optional dependency (`pip install groundswell[plot]`); it is imported inside the
functions, with the non-interactive Agg backend, so importing this module never needs it.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

# The fault kinds drawn by default, each with a fixed color so plots of different runs compare.
FAULT_COLORS: dict[str, str] = {
    "kill": "tab:red",
    "kill-coordinator": "darkred",
    "restart": "tab:green",
    "freeze": "tab:blue",
    "thaw": "tab:cyan",
    "join": "tab:purple",
    "leave": "tab:orange",
}
_EXTRA_COLORS = ("tab:brown", "tab:pink", "tab:olive", "tab:gray", "gold", "navy", "teal", "magenta")
_STYLES = {"kill-coordinator": "-", "kill": "--", "freeze": ":", "thaw": ":"}
_MAX_PEER_LABELS = 40  # above this many events, per-event peer labels are left off


def _require_matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError(
            "plotting needs matplotlib, an optional dependency: pip install 'groundswell[plot]' "
            "(or pip install matplotlib)"
        ) from exc
    matplotlib.use("Agg", force=True)  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def _losses(report: dict) -> list[float]:
    out = []
    for v in report.get("eval_loss_by_round") or []:
        try:
            out.append(float(v) if v is not None else math.nan)
        except (TypeError, ValueError):
            out.append(math.nan)
    return out


def _round_ends(report: dict, n: int) -> list[float] | None:
    """`round_end_t` when it is usable (one non-decreasing time per plotted round), else None."""
    ends = report.get("round_end_t")
    if not ends or n == 0:
        return None
    try:
        ends = [float(t) for t in ends][:n]
    except (TypeError, ValueError):
        return None
    if len(ends) < n or any(b < a for a, b in itertools.pairwise(ends)):
        return None
    return ends


def _round_position(t: float, ends: Sequence[float]) -> float:
    """Where time `t` falls on the round axis: loss of round i is drawn at x=i, and round i runs
    from the end of round i-1 (time 0 for round 0) to ends[i], so an event during round i lands
    between i-1 and i. Before 0 or after the last round, the nearest round's duration extrapolates."""
    xp = [0.0, *ends] if ends[0] > 0 else list(ends)
    fp = [float(i) for i in range(-1 if ends[0] > 0 else 0, len(ends))]
    if len(xp) == 1:
        return fp[0]
    i = min(max(bisect.bisect_right(xp, t), 1), len(xp) - 1)
    x0, x1, y0, y1 = xp[i - 1], xp[i], fp[i - 1], fp[i]
    return y0 if x1 == x0 else y0 + (t - x0) * (y1 - y0) / (x1 - x0)


def _events(report: dict, kinds: Iterable[str] | None) -> list[dict]:
    wanted = set(FAULT_COLORS) if kinds is None else set(kinds)
    out = []
    for e in report.get("events") or []:
        if not isinstance(e, dict) or e.get("kind") not in wanted:
            continue
        try:
            t = float(e["t"])
        except (KeyError, TypeError, ValueError):
            continue
        out.append({"t": t, "kind": str(e["kind"]), "peer": str(e.get("peer", ""))})
    return sorted(out, key=lambda e: e["t"])


def _colors(kinds: Iterable[str]) -> dict[str, str]:
    colors, extra = {}, iter(_EXTRA_COLORS * 4)
    for k in kinds:
        colors[k] = FAULT_COLORS.get(k) or next(extra, "black")
    return colors


def _draw_events(ax: Any, xs: list[tuple[float, dict]], colors: dict[str, str], label_peers: bool) -> None:
    seen: set[str] = set()
    for x, e in xs:
        k = e["kind"]
        ax.axvline(x, color=colors[k], linestyle=_STYLES.get(k, "-."), linewidth=1.2, alpha=0.8,
                   label=k if k not in seen else None)
        seen.add(k)
        if label_peers and e["peer"]:
            ax.annotate(e["peer"], xy=(x, 1.0), xycoords=("data", "axes fraction"), xytext=(2, -2),
                        textcoords="offset points", rotation=90, va="top", ha="left", fontsize=6,
                        color=colors[k])


def plot_loss(report: dict, path: Path, *, kinds: Iterable[str] | None = None, title: str | None = None) -> None:
    """Write a PNG of held-out loss vs wall time (s) and vs round, with fault events as vertical
    lines colored by kind (one legend entry per kind).

    `report` is a simulate report.json dict: `eval_loss_by_round`, optionally `round_end_t`
    (seconds since start at which each round ended; without it only the round panel is drawn and
    events, which carry times, cannot be placed) and `events` ({"t", "kind", "peer"}). `kinds`
    picks the event kinds to draw (default: the fault kinds in `FAULT_COLORS`).
    ImportError if matplotlib is not installed.
    """
    plt = _require_matplotlib()
    path = Path(path)
    losses = _losses(report)
    n = len(losses)
    rounds = list(range(n))
    ends = _round_ends(report, n)
    events = _events(report, kinds)
    colors = _colors(dict.fromkeys(e["kind"] for e in events))
    label_peers = len(events) <= _MAX_PEER_LABELS

    panels = 2 if ends is not None else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.5), squeeze=False)
    axes = list(axes[0])
    try:
        if ends is not None:
            ax = axes.pop(0)
            ax.plot(ends, losses, marker="o", markersize=3, color="black", label="held-out loss")
            _draw_events(ax, [(e["t"], e) for e in events], colors, label_peers)
            ax.set_xlabel("wall time (s)")
            ax.set_ylabel("held-out loss")
            ax.set_title("loss vs wall time")
            ax.grid(True, alpha=0.3)
        ax = axes.pop(0)
        ax.plot(rounds, losses, marker="o", markersize=3, color="black", label="held-out loss")
        if ends is not None:
            _draw_events(ax, [(_round_position(e["t"], ends), e) for e in events], colors, label_peers)
        elif events:
            ax.text(0.01, 0.01, "no round_end_t in the report: events not placed", transform=ax.transAxes,
                    fontsize=7, color="gray")
        ax.set_xlabel("round")
        ax.set_ylabel("held-out loss")
        ax.set_title("loss vs round")
        ax.grid(True, alpha=0.3)
        if n == 0:
            ax.text(0.5, 0.5, "no rounds completed", transform=ax.transAxes, ha="center", va="center")
        heading = title
        if heading is None and "peers" in report:
            heading = (f"{report.get('peers')} peers, {report.get('algorithm', '?')}/{report.get('codec', '?')}, "
                       f"{report.get('rounds_completed', n)} rounds")
        if heading:
            fig.suptitle(heading, fontsize=10)
        # One legend for the figure, below the panels: one entry per line kind.
        handles: dict[str, Any] = {}
        for a in fig.axes:
            for h, label in zip(*a.get_legend_handles_labels()):
                handles.setdefault(label, h)
        fig.tight_layout(rect=(0, 0.1, 1, 1))
        if handles:
            fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=min(len(handles), 8),
                       fontsize=8, frameon=False)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, format="png", dpi=110)
    finally:
        plt.close(fig)
