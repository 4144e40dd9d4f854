"""A p2pd daemon that crashes says why: its last words reach our log, not only hivemind's DEBUG."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest
from groundswell.peer import daemon
from groundswell.peer.daemon import DaemonOutput, release_private_sockets, watch_daemon, with_private_sockets
from groundswell.peer.net_errors import NetworkError

PANIC = ["panic: runtime error: invalid memory address or nil pointer dereference",
         "[signal SIGSEGV: segmentation violation code=0x1 addr=0x0 pc=0x9e4287]", "", "goroutine 2019 [running]:"]


def test_a_crash_is_kept_with_the_first_lines_of_its_trace_and_log_records_are_not():
    out = DaemonOutput()
    out.keep("Control socket: /unix/tmp/x.sock")
    out.keep('{"level":"warn","ts":"2026-12-07T01:45:00.000Z","logger":"swarm","msg":"dial failed"}')
    assert out.last_words() == ["Control socket: /unix/tmp/x.sock"]  # no crash: its last lines
    for line in PANIC + [f"frame {i}" for i in range(100)]:
        out.keep(line)
    said = out.last_words()
    assert said[:4] == PANIC and len(said) == DaemonOutput.FATAL_LINES
    quit_ = DaemonOutput()
    quit_.keep("SIGQUIT: quit")  # what Go prints when sent SIGQUIT, then exits with code 2
    assert quit_.last_words() == ["SIGQUIT: quit"]


def test_the_nodes_p2p_class_keeps_the_daemons_output_and_still_logs_it(monkeypatch):
    monkeypatch.setattr(daemon, "DAEMON_OUTPUT", DaemonOutput())
    logged: list[str] = []

    class P2P:
        @staticmethod
        def _make_process_args(*args, **kwargs):
            return []

        @staticmethod
        def _log_p2pd_message(line: str) -> None:
            logged.append(line)

    cls = with_private_sockets(P2P)
    try:
        cls()._log_p2pd_message(PANIC[0])  # as hivemind's reader calls it, on the instance
    finally:
        release_private_sockets()
    assert logged == [PANIC[0]] and daemon.DAEMON_OUTPUT.fatal == [PANIC[0]]


def test_a_daemon_that_exits_raises_and_logs_its_last_words(monkeypatch, caplog):
    monkeypatch.setattr(daemon, "DAEMON_OUTPUT", DaemonOutput())
    for line in PANIC:
        daemon.DAEMON_OUTPUT.keep(line)

    async def exits() -> int:
        return 2

    p2p = SimpleNamespace(_child=SimpleNamespace(wait=exits))
    with caplog.at_level(logging.ERROR, logger="groundswell.peer.daemon"), \
            pytest.raises(NetworkError, match=r"exited \(code 2\)"):
        asyncio.run(watch_daemon(p2p))
    assert any(PANIC[0] in r.getMessage() and "code 2" in r.getMessage() for r in caplog.records)
