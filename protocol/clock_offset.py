"""How far our clock is from the other peers', estimated from the stamps on their requests.

Rounds follow the wall clock (`plan.attempt_for`): a peer whose clock is S s ahead takes each
attempt's contribution cut-off for S s earlier than it is, and trains S s less (a review saw a
peer 2.5 s ahead, within the DHT's 3 s start check, left out of 15 of 19 rounds), and a leader
S s behind stamps its commits S s early, costing everyone S s of the next round. Hivemind checks
the clock against one bootstrap peer at start only; this keeps checking against everyone.

Each verified small request carries its sender's time at sealing (the envelope's stamp); the
stamp minus our time when the request had arrived is the sender's clock minus ours, less the time
from sealing to arrival. Per peer the largest of its recent samples is kept (delays only lower a
sample), and across the peers heard from lately the median (of two middle values, the one nearer
zero): a few peers with wrong clocks, or lying stamps, do not move it. A step of our own clock
(the user set it) clears every sample: they were taken against the old one.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable

MAX_PEERS = 64  # peers whose samples are kept (the most recently heard)
SAMPLES_PER_PEER = 8  # recent samples kept per peer
MIN_PEERS = 2  # peers needed for an estimate
SAMPLE_LIFE_S = 600.0  # a peer not heard from for this long (gone, say) no longer counts
CLOCK_STEP_S = 0.5  # our wall clock moving this far against the monotonic one is a step: samples cleared


class ClockOffsets:
    """Recent (sender's stamp - our receipt time) samples per peer; our clock's offset from theirs."""

    def __init__(self, wall: Callable[[], float] = time.time, mono: Callable[[], float] = time.monotonic) -> None:
        self._wall, self._mono = wall, mono
        self._samples: OrderedDict[str, deque[float]] = OrderedDict()
        self._heard: dict[str, float] = {}  # peer -> monotonic time of its newest sample
        self._wall_minus_mono: float | None = None

    def note(self, peer: str, sample_s: float) -> None:
        """Record one sample: `peer`'s stamp on a verified request minus our time when it had arrived."""
        self._clear_after_a_step()
        samples = self._samples.pop(peer, None) or deque(maxlen=SAMPLES_PER_PEER)
        samples.append(sample_s)
        self._samples[peer] = samples
        self._heard[peer] = self._mono()
        if len(self._samples) > MAX_PEERS:
            gone, _ = self._samples.popitem(last=False)
            del self._heard[gone]

    def ours(self) -> tuple[float, int] | None:
        """(our clock minus the other peers', in s; how many peers it rests on), or None if too few."""
        self._clear_after_a_step()
        lately = self._mono() - SAMPLE_LIFE_S
        ours = sorted(-max(s) for peer, s in self._samples.items() if self._heard[peer] >= lately)
        if len(ours) < MIN_PEERS:
            return None
        # The median; of an even count's two middle values, the one nearer zero: with two peers,
        # one of them off (not us) must not make us look off by half its skew.
        low, high = ours[(len(ours) - 1) // 2], ours[len(ours) // 2]
        return min(low, high, key=abs), len(ours)

    def _clear_after_a_step(self) -> None:
        base = self._wall() - self._mono()
        if self._wall_minus_mono is not None and abs(base - self._wall_minus_mono) > CLOCK_STEP_S:
            self._samples.clear()
            self._heard.clear()
        self._wall_minus_mono = base


def skew_warning(offset: tuple[float, int] | None, limit_s: float) -> str | None:
    """What to tell the user about `ClockOffsets.ours()`, or None when within `limit_s`."""
    if offset is None or abs(offset[0]) <= limit_s:
        return None
    skew, peers = offset
    effect = ("each round leaves it that much less time to train, and its work may miss rounds" if skew > 0 else
              "the rounds it leads start that much early for everyone else")
    return (f"this computer's clock seems {abs(skew):.1f} s {'ahead of' if skew > 0 else 'behind'} the other "
            f"peers' (from {peers} peers' messages): {effect}; turn on network time (e.g. `timedatectl set-ntp true`)")
