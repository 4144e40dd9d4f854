"""How `groundswell status` shows the run: a table of the peers' published records. Every string
in a record is its peer's own word (in an open run, anyone's): shown as text, never rich markup."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table

# The command's output (as `--json`'s is): on stdout, so that `status ... > file` keeps it. The
# CLI's own console (stderr) carries progress and errors.
console = Console(emoji=False)  # ":ab:" in an IPv6 address is an emoji code to rich


def print_status(run_id: str, rows: list[dict]) -> None:
    """`status`'s table and lines, from the peers' published records (`rows`)."""
    from rich.markup import escape

    online = f"{len(rows)} peer{'' if len(rows) == 1 else 's'} online"
    table = Table(title=escape(f"run {run_id}: {online}"), box=box.SIMPLE_HEAD,
                  collapse_padding=True, pad_edge=False, show_edge=False)
    for col in ("peer", "role", "reach", "round", "params", "loss", "sent", "refused", "bans", "age"):
        # fits an 80-column terminal without cutting ids or hashes (they are what one compares)
        table.add_column(col, no_wrap=True, justify="left" if col in ("peer", "role") else "right")
    for row in rows:
        loss = "-" if row["loss"] is None else f"{row['loss']:.4f}"
        role = {"coordinator": "coord", "volunteer": "vol"}.get(row["role"], row["role"])
        # public; behind a NAT ("nat"), with N peers reached directly by a hole punch ("nat+N")
        reach = {"public": "pub", "private": "nat"}.get(row["reachability"], "?")  # "?": not probed yet
        reach += f"+{len(row['hole_punched'])}" if row["hole_punched"] else ""
        # every string here is a peer's own word (in an open run, anyone's): text, never rich markup
        table.add_row(*map(escape, (row["peer"][-10:], role, reach, str(row["round"]), row["params_hash"][:8], loss,
                                    f"{row['bytes_sent'] / 1e6:.1f}MB", str(row["refused_messages"]),
                                    ", ".join(b[-8:] for b in row["banning"]) or "-", f"{row['age_s']:.0f}s")))
    console.print(table)
    for row in rows:  # leaders that score contributions publish the scores of their latest scored round
        if row["scores"]:
            shown = ", ".join(f"{who[-8:]} {v}" for who, _, v in (s.partition("=") for s in row["scores"]))
            console.print(escape(f"scores by {row['peer'][-10:]} (probe loss change; > threshold is dropped): "
                                 f"{shown}"), highlight=False)
    banned = sorted({b for row in rows for b in row["banning"]})
    if banned:
        console.print(escape(f"banned by some peer now: {', '.join(banned)}"), highlight=False)
