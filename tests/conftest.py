"""Shared fixtures: the stdlib corpus is loaded once per test session."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch spins up its thread pool

import pytest
import torch

torch.set_num_threads(1)  # several test processes may share 2 cores; one thread each is steadier

from groundswell.peer.data import Corpus, load_corpus


@pytest.fixture(scope="session")
def corpus() -> Corpus:
    return load_corpus("stdlib")
