"""A node whose network stops by itself (a task of its TaskGroup failed) says so and refuses
every later call, instead of leaving its trainer to go on as a peer nobody can reach."""

from __future__ import annotations

import time

import pytest
from groundswell.peer.net_errors import NetworkError
from groundswell.peer.swarm import NodeOptions, SwarmNode
from groundswell.protocol.identity import Identity

pytestmark = pytest.mark.timeout(90)


async def _one() -> int:
    return 1


def test_a_node_whose_task_failed_says_so_and_refuses_every_later_call(tmp_path, caplog):
    ident = Identity.generate()
    ident.save(tmp_path / "id.key")
    node = SwarmNode(ident, str(tmp_path / "id.key"), NodeOptions(reachability="public"))
    node.start()
    try:
        assert node.call(_one(), timeout_s=10) == 1

        async def boom() -> None:
            raise RuntimeError("a bug in one of the node's tasks")

        async def spawn() -> None:
            node._tasks.create_task(boom())

        with caplog.at_level("ERROR", logger="groundswell.peer.swarm"):
            node.call(spawn(), timeout_s=10)
            deadline = time.monotonic() + 30
            while True:  # the TaskGroup takes every task and the daemon down, then the node is down
                try:
                    node.call(_one(), timeout_s=10)
                except NetworkError as exc:
                    assert "network stopped" in str(exc) and "a bug in one of the node's tasks" in str(exc)
                    break
                assert time.monotonic() < deadline, "the node never reported its failure"
                time.sleep(0.1)
        with pytest.raises(NetworkError, match="network stopped"):
            node.submit(_one())
        logged = [r for r in caplog.records if "the network stopped" in r.getMessage()]
        assert len(logged) == 1 and logged[0].exc_info is not None
    finally:
        node.close()
