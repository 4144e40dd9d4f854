#!/usr/bin/env python3
"""delayline: a userspace stand-in for ``tc netem delay ... loss ...`` on kernels without sch_netem.

Each link is a pair of interfaces in one network namespace, ``near:far`` (two ends of two veth
pairs that would otherwise be one cable). Frames arriving on ``near`` wait ``delay_ms`` and are
dropped with probability ``loss_pct`` before they leave on ``far``; frames arriving on ``far``
go to ``near`` at once. So, like netem on one end of a cable, one direction carries the delay.
A link may set its own figures, both ways: ``near:far:DELAY:LOSS:RDELAY:RLOSS`` (ms and percent;
RDELAY and RLOSS apply to frames going from ``far`` to ``near``).

    delayline.py --delay-ms 40 --loss-pct 0.1 NEAR:FAR[:D:L:RD:RL] [...]     (root; prints "ready")

Frames are read and written through AF_PACKET sockets with a virtio-net header, so TCP
segmentation and checksum offloads pass through untouched: a 60 kB GSO frame is one read and one
write, and the kernel cuts it into segments where it has to. Loss is drawn once per frame with the
probability that at least one of its segments would have been lost. The delay is a FIFO per link
(a constant delay never reorders), served by one epoll loop; the process renices itself so that
a busy CPU delays its timers as little as possible.
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import random
import select
import signal
import socket
import struct
import sys
import time

ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_VNET_HDR = 15
PACKET_IGNORE_OUTGOING = 23
SO_RCVBUFFORCE = 33
VNET_HDR = struct.Struct("=BBHHHH")  # flags, gso_type, hdr_len, gso_size, csum_start, csum_offset
MAX_FRAME = VNET_HDR.size + 65536 + 64
QUEUE_LIMIT_BYTES = 64 << 20  # per link; at 50 Mbit/s and 40 ms a link holds ~250 kB


def open_port(ifname: str) -> socket.socket:
    """A non-blocking raw socket on ``ifname`` that sees only frames arriving there."""
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    s.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
    s.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
    s.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 8 << 20)
    s.bind((ifname, 0))
    s.setblocking(False)
    return s


def segments(frame: bytes) -> int:
    """How many wire packets a frame (virtio-net header first) stands for."""
    _, gso_type, hdr_len, gso_size, _, _ = VNET_HDR.unpack_from(frame)
    if gso_type == 0 or gso_size == 0:
        return 1
    return max(1, math.ceil((len(frame) - VNET_HDR.size - hdr_len) / gso_size))


class _Way:
    """One direction of a cable: frames read on `src` wait `delay_s` (or are lost) before `dst`."""

    def __init__(self, src: socket.socket, dst: socket.socket, delay_s: float, loss: float,
                 rng: random.Random, counts: collections.Counter[str]) -> None:
        self.src, self.dst, self.delay_s, self.loss, self.rng, self.counts = src, dst, delay_s, loss, rng, counts
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.queued_bytes = 0

    def on_input(self) -> None:
        """Queue (or, undelayed and lossless, pass on) what arrived on `src`, after the loss draw."""
        now = time.monotonic()
        for frame in _drain(self.src):
            if self.loss > 0 and self.rng.random() < 1 - (1 - self.loss) ** segments(frame):
                self.counts["lost"] += 1
            elif self.delay_s <= 0 and not self.queue:
                _send(self.dst, frame, self.counts)
            elif self.queued_bytes + len(frame) > QUEUE_LIMIT_BYTES:
                self.counts["overflow"] += 1
            else:
                self.queue.append((now + self.delay_s, frame))
                self.queued_bytes += len(frame)

    def release(self, now: float) -> float | None:
        """Send every frame that is due; the time the next one falls due, if any."""
        while self.queue and self.queue[0][0] <= now:
            frame = self.queue.popleft()[1]
            self.queued_bytes -= len(frame)
            _send(self.dst, frame, self.counts)
        return self.queue[0][0] if self.queue else None


class Link:
    """One cable: ``near`` -> ``far`` delayed and lossy; ``far`` -> ``near`` too if given figures."""

    def __init__(self, near: str, far: str, delay_s: float, loss: float, rng: random.Random,
                 rdelay_s: float = 0.0, rloss: float = 0.0) -> None:
        self.near, self.far = open_port(near), open_port(far)
        self.counts = collections.Counter[str]()
        self.ways = (_Way(self.near, self.far, delay_s, loss, rng, self.counts),
                     _Way(self.far, self.near, rdelay_s, rloss, rng, self.counts))

    def release(self, now: float) -> float | None:
        """Send every frame due either way; the time the next one falls due, if any."""
        dues = [d for d in (way.release(now) for way in self.ways) if d is not None]
        return min(dues) if dues else None


def _send(port: socket.socket, frame: bytes, counts: collections.Counter[str]) -> None:
    try:
        port.send(frame)
    except OSError:  # ENOBUFS / EAGAIN: the wire drops it, as a full NIC queue would
        counts["send_failed"] += 1


def parse_link(spec: str, delay_ms: float, loss_pct: float) -> tuple[str, str, float, float, float, float]:
    """``near:far`` or ``near:far:D:L:RD:RL`` -> (near, far, delay_s, loss, rdelay_s, rloss)."""
    parts = spec.split(":")
    if len(parts) == 2:
        figures = [delay_ms, loss_pct, 0.0, 0.0]
    elif len(parts) == 6:
        figures = [float(v) for v in parts[2:]]
    else:
        raise ValueError(f"{spec!r}: give NEAR:FAR or NEAR:FAR:DELAY:LOSS:RDELAY:RLOSS")
    d, l, rd, rl = figures
    if d < 0 or rd < 0 or not (0 <= l < 100 and 0 <= rl < 100):
        raise ValueError(f"{spec!r}: delays must be >= 0 and losses in [0, 100)")
    return parts[0], parts[1], d / 1000, l / 100, rd / 1000, rl / 100


def _drain(port: socket.socket) -> list[bytes]:
    frames = []
    while True:
        try:
            frames.append(port.recv(MAX_FRAME))
        except (BlockingIOError, InterruptedError):
            return frames


def serve(links: list[Link]) -> None:
    """The event loop: read, queue, release on time; runs until SIGTERM/SIGINT."""
    ep = select.epoll()
    handlers = {}
    for link in links:
        for way in link.ways:
            ep.register(way.src.fileno(), select.EPOLLIN)
            handlers[way.src.fileno()] = way.on_input
    stop = False

    def _stop(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    next_due: float | None = None
    while not stop:
        timeout = -1.0 if next_due is None else max(0.0, next_due - time.monotonic())
        try:
            events = ep.poll(timeout)
        except InterruptedError:
            continue
        for fd, _ in events:
            handlers[fd]()
        now = time.monotonic()
        dues = [d for d in (link.release(now) for link in links) if d is not None]
        next_due = min(dues) if dues else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--delay-ms", type=float, required=True)
    ap.add_argument("--loss-pct", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("links", nargs="+", metavar="NEAR:FAR[:DELAY:LOSS:RDELAY:RLOSS]")
    a = ap.parse_args(argv)
    if a.delay_ms < 0 or not 0 <= a.loss_pct < 100:
        ap.error("--delay-ms must be >= 0 and --loss-pct in [0, 100)")
    rng = random.Random(a.seed)
    try:
        specs = [parse_link(spec, a.delay_ms, a.loss_pct) for spec in a.links]
        links = [Link(near, far, d, l, rng, rd, rl) for near, far, d, l, rd, rl in specs]
    except (OSError, TypeError, ValueError) as e:
        print(f"delayline: cannot open the links: {e}", file=sys.stderr)
        return 2
    try:
        os.nice(-10)
    except OSError:
        pass  # not allowed: timing under load is then only as good as the scheduler's
    print("ready", flush=True)
    serve(links)
    return 0


if __name__ == "__main__":
    sys.exit(main())
