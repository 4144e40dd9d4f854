"""A node raises its soft open-file limit at start: every inbound stream holds a descriptor, and
the usual soft limit of 1024 ran out before the guard's cap on streams (1024 for all peers)."""

from __future__ import annotations

import resource

import pytest
from groundswell.peer.daemon import raise_open_file_limit


@pytest.mark.parametrize("hard, kernel_max, expected", [
    (4096, None, 4096),  # up to the hard limit
    (1 << 20, None, 1 << 16),  # but no further than asked for
    (resource.RLIM_INFINITY, 10240, 10240),  # macOS: "unlimited" hard limit, refused past the kernel's maximum
    (resource.RLIM_INFINITY, 512, 1024),  # refused outright: the limit stays, said in a warning
])
def test_the_soft_limit_is_raised_as_far_as_allowed(monkeypatch, hard, kernel_max, expected):
    limits = {"soft": 1024}

    def setrlimit(which, pair):
        soft, _ = pair
        if kernel_max is not None and soft > kernel_max:
            raise ValueError("not allowed to raise maximum limit")
        limits["soft"] = soft

    monkeypatch.setattr(resource, "getrlimit", lambda which: (limits["soft"], hard))
    monkeypatch.setattr(resource, "setrlimit", setrlimit)
    assert raise_open_file_limit() == expected and limits["soft"] == expected
