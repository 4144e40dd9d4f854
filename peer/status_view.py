"""How `groundswell status` shows the run: a table of the peers' published records. Every string
in a record is its peer's own word (in an open run, anyone's): shown as text, never rich markup."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table

# The command's output (as `--json`'s is): on stdout, so that `status ... > file` keeps it. The
# CLI's own console (stderr) carries progress and errors.
console = Console(emoji=False)  # ":ab:" in an IPv6 address is an emoji code to rich


MAX_ROWS = 50  # an open run's records are anyone's: a thousand fake ones must not flood the terminal
MAX_BANNED = 20
MAX_SCORERS, MAX_SCORES = 5, 16  # score lines shown: leaders, and contributors per leader


def _text(value: object) -> str:
    """A peer's own word, safe to print: no rich markup, and no control characters (an escape
    sequence in a record would clear or rewrite the user's terminal)."""
    from rich.markup import escape

    return escape("".join(c if c.isprintable() else "?" for c in str(value)))


# A record's numbers are its peer's word too, each up to what the schema allows: each is shown in
# a bounded width (a loss of 1e308, printed as 314 digits in a column that never wraps, pushed
# every column after it off the table, for every row; a review found).
def _loss(value: float) -> str:
    """A held-out loss: 4 decimals, or 4 digits if it is huge."""
    return f"{value:.4f}" if abs(value) < 1e6 else f"{value:.4g}"


def _count(value: object) -> str:
    """A round or a count: in full below ten million, else as a power of ten ("1e+12")."""
    return f"{value:.0e}" if isinstance(value, int) and abs(value) >= 10**7 else str(value)


def _bytes(value: int) -> str:
    """Bytes sent: in MB (one decimal) below 100 GB, in GB below 100 TB, else as a power of ten."""
    for unit, scale in (("MB", 1e6), ("GB", 1e9)):
        if value < 1e5 * scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.0e}B"


def print_status(run_id: str, rows: list[dict], coordinator_id: str = "") -> None:
    """`status`'s table and lines, from the peers' published records (`rows`). Only the peer
    whose id is `coordinator_id` (the bootstrap line's) is shown as the coordinator; another
    that claims it is marked "coord?". The coordinator comes first."""
    rows = sorted(rows, key=lambda r: r["peer"] != coordinator_id)
    # The volunteers apart, as the coordinator's live table counts them ("peers online" there is
    # volunteers: a review saw the two figures differ by one and could not tell why).
    volunteers = sum(1 for r in rows if r["peer"] != coordinator_id)
    online = f"{len(rows)} peer{'' if len(rows) == 1 else 's'} online ({volunteers} besides the coordinator)"
    table = Table(title=_text(f"run {run_id}: {online}"), box=box.SIMPLE_HEAD,
                  collapse_padding=True, pad_edge=False, show_edge=False)
    # fits an 80-column terminal without cutting ids or hashes (they are what one compares): those
    # keep their width, the others give way first
    widths = {"peer": 10, "params": 8, "loss@round": 6}
    # (loss@round: the held-out loss and the round it was measured after, up to eval.every_rounds
    # - 1 before the record's; ref: messages this peer refused)
    for col in ("peer", "role", "reach", "round", "params", "loss@round", "sent", "ref", "bans", "age"):
        table.add_column(col, no_wrap=True, justify="left" if col in ("peer", "role") else "right",
                         min_width=widths.get(col))
    # Peers at one round whose hashes differ: marked "!", since a hash shown cut short could look
    # the same (and a hostile peer can publish any prefix it likes; a review, 2026-12-07).
    hashes: dict[object, set[str]] = {}
    for row in rows:
        hashes.setdefault(row["round"], set()).add(row["params_hash"])
    for row in rows[:MAX_ROWS]:
        loss = "-" if row["loss"] is None else f"{_loss(row['loss'])}@{_count(row.get('loss_round'))}"
        params = row["params_hash"][:8] + ("!" if len(hashes[row["round"]]) > 1 else "")
        role = {"coordinator": "coord", "volunteer": "vol"}.get(row["role"], row["role"])
        if role == "coord" and row["peer"] != coordinator_id:
            role = "coord?"  # a claim: not the key the bootstrap line names
        role = role if len(role) <= 6 else role[:5] + "…"  # (a record's role may be any 16 characters)
        # public; behind a NAT ("nat"), with N peers reached directly by a hole punch ("nat+N")
        reach = {"public": "pub", "private": "nat"}.get(row["reachability"], "?")  # "?": not probed yet
        reach += f"+{len(row['hole_punched'])}" if row["hole_punched"] else ""
        # every string here is a peer's own word (in an open run, anyone's): text, never markup;
        # the peers it bans are counted here and listed below (a list squeezed every column)
        table.add_row(*map(_text, (row["peer"][-10:], role, reach, _count(row["round"]), params, loss,
                                   _bytes(row["bytes_sent"]), _count(row["refused_messages"]),
                                   str(len(row["banning"])) if row["banning"] else "-", f"{row['age_s']:.0f}s")))
    console.print(table)
    if len(rows) > MAX_ROWS:
        console.print(f"... and {len(rows) - MAX_ROWS} more peers (--json lists them all)", highlight=False)
    scorers = [row for row in rows[:MAX_ROWS] if row["scores"]]
    for row in scorers[:MAX_SCORERS]:  # leaders that score contributions publish the scores of their latest scored round
        if row["scores"]:
            more = f" and {len(row['scores']) - MAX_SCORES} more" if len(row["scores"]) > MAX_SCORES else ""
            shown = ", ".join(f"{who[-8:]} {str(v)[:12]}" for who, _, v in
                              (s.partition("=") for s in row["scores"][:MAX_SCORES])) + more
            console.print(_text(f"scores by {row['peer'][-10:]} (probe loss change; > threshold is dropped): "
                                f"{shown}"), highlight=False)
    if len(scorers) > MAX_SCORERS:  # (crafted records' scores flooded the terminal: 6,375 lines)
        console.print(f"... and scores by {len(scorers) - MAX_SCORERS} more peers (--json lists them all)",
                      highlight=False)
    banned = sorted({b for row in rows for b in row["banning"]})
    if banned:
        more = f" and {len(banned) - MAX_BANNED} more" if len(banned) > MAX_BANNED else ""
        console.print(_text(f"banned by some peer now: {', '.join(banned[:MAX_BANNED])}{more}"), highlight=False)
