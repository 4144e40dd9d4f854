"""Misbehaving volunteers, for `groundswell simulate --byzantine K --attack KIND` and tests.

A byzantine volunteer runs the honest program but tampers with the payloads it contributes,
after its own optimizer has prepared them (so its local state stays honest and only the swarm
sees the attack):
- scale:    its update times 10;
- random:   Gaussian noise 10 times the norm of its update;
- signflip: its update negated;
- nan:      its update with a NaN planted in every segment's payload (a hostile encoder);
- stale:    the update it sent three rounds earlier, signed afresh for this round.
"""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from groundswell.compression import Codec, Payload

ATTACKS = ("scale", "random", "signflip", "nan", "stale")
SCALE = 10.0
STALE_ROUNDS = 3

# one NaN in the wire dtype of each codec's value buffer
_NAN = {"fp32": struct.pack("<f", float("nan")), "fp16": b"\x00\x7e", "bf16": b"\xc0\x7f"}


@dataclass
class Attack:
    """One volunteer's attack; `tamper` turns its honest payloads into what it sends."""

    kind: str
    codec: Codec
    seed: int = 0
    _sent: deque = field(default_factory=lambda: deque(maxlen=STALE_ROUNDS + 1))

    def __post_init__(self) -> None:
        if self.kind not in ATTACKS:
            raise ValueError(f"unknown attack {self.kind!r}; choose one of {', '.join(ATTACKS)}")
        self._rng = torch.Generator().manual_seed(self.seed)

    def tamper(self, payloads: Sequence[Payload]) -> list[Payload]:
        """The payloads a byzantine peer sends instead of `payloads`."""
        honest = list(payloads)
        self._sent.append(honest)
        if self.kind == "stale":
            return self._sent[0]  # three rounds old once there is such a round
        if self.kind == "nan":
            return [_plant_nan(p) for p in honest]
        out = []
        for p in honest:
            x = self.codec.decode(p, device="cpu")
            if self.kind == "scale":
                x = x * SCALE
            elif self.kind == "signflip":
                x = -x
            else:  # random
                noise = torch.randn(x.shape, generator=self._rng)
                x = noise * (SCALE * x.norm() / noise.norm().clamp_min(1e-30))
            out.append(self.codec.encode(x))
        return out


def _plant_nan(p: Payload) -> Payload:
    """The payload with its first value (or scale, or level) replaced by NaN: only a hostile
    encoder makes this, since every codec refuses to encode non-finite values."""
    buffers = dict(p.buffers)
    if p.codec == "sparseloco":
        name, nan = "level", _NAN["fp32"]
    elif p.codec == "int8":
        name, nan = "scale", _NAN["fp32"]
    else:
        name, nan = "data", _NAN[p.codec]
    buf = buffers[name]
    if len(buf) >= len(nan):
        buffers[name] = nan + buf[len(nan):]
    return Payload(p.codec, p.shape, dict(p.params), buffers)
