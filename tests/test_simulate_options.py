"""`simulate`'s options as the manifest it would launch: checked in-process, nothing is started."""

from __future__ import annotations

import math
import tomllib

import pytest
from groundswell.peer.config import ConfigError
from groundswell.peer.manifest import manifest_from_mapping
from groundswell.peer.simulate import SimulateOptions, check_manifest, manifest_toml


@pytest.mark.parametrize("options, words", [
    ({"error_decay": -0.5}, "--error-decay must be in [0, 1], got -0.5"),
    ({"error_decay": math.nan}, "--error-decay must be a finite number, got nan"),
    ({"warmup_steps": -7}, "--warmup must be >= 0, got -7"),
])
def test_an_out_of_range_option_is_refused_not_replaced_by_the_default(options, words):
    # a value below zero used to mean "the default": -0.5, nan or -7 ran silently with 0.95 or min(50, 2 H)
    with pytest.raises(ConfigError) as info:
        check_manifest(SimulateOptions(**options))
    assert str(info.value) == words


@pytest.mark.parametrize("inner_steps, warmup", [(20, 40), (30, 50)])
def test_none_is_the_default_and_a_given_value_is_kept(inner_steps, warmup):
    opts = SimulateOptions(inner_steps=inner_steps, error_decay=None, warmup_steps=None)
    check_manifest(opts)
    manifest = manifest_from_mapping(tomllib.loads(manifest_toml(opts)))
    assert manifest.outer.error_decay == 0.95 and manifest.inner.warmup_steps == warmup
    given = SimulateOptions(inner_steps=inner_steps, error_decay=0.0, warmup_steps=0)
    manifest = manifest_from_mapping(tomllib.loads(manifest_toml(given)))
    assert manifest.outer.error_decay == 0.0 and manifest.inner.warmup_steps == 0
