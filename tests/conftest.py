"""Shared fixtures: the stdlib corpus is loaded once per test session."""

from __future__ import annotations

import contextlib
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch spins up its thread pool

import pytest
import torch

torch.set_num_threads(1)  # several test processes may share 2 cores; one thread each is steadier

from groundswell.peer.data import Corpus, load_corpus


@pytest.fixture(autouse=True)
def _release_state_locks():
    """Commands run in-process (CliRunner) lock their state dir and identity for the process's
    lifetime; let go after each test, as a process exit would."""
    yield
    from groundswell.peer.locks import release_all

    release_all()


@pytest.fixture(scope="session")
def corpus() -> Corpus:
    return load_corpus("stdlib")


@pytest.fixture
def make_cluster():
    """Make in-process swarm clusters (tests/swarm_harness.py); every one is closed afterwards."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from swarm_harness import Cluster

    with contextlib.ExitStack() as made:  # every cluster closed, even when an earlier close fails

        def make(*args, **kw) -> Cluster:
            c = Cluster(*args, **kw)
            made.callback(c.close)
            return c

        yield make


@pytest.fixture(scope="module")
def net(tmp_path_factory):
    """Two real libp2p daemons on loopback (tests/p2p_net.py), one pair per test module."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from p2p_net import open_net

    yield from open_net(tmp_path_factory)
