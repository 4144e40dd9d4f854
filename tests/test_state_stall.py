"""A state server that stops sending: the stream's trailer read gives up after a stall bound (as
the direct path does), and a joiner blames its own link as too slow only when bytes kept coming.
Real transport, `fetch_state` and `download_state`; only libp2p is stood in for."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from groundswell.protocol.schema import StateReply, StateRequest
from test_state_trust import COORDINATORS, _served_state, make_participant


@pytest.fixture
def participant(tmp_path, corpus):
    return make_participant(tmp_path, corpus)


def _reader(data: bytes = b"", eof: bool = False) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


def test_a_bulk_frame_cut_short_is_an_incomplete_read_holding_no_copy_of_what_came():
    # (a review: its `partial` was a copy of every byte received, a second state's worth of
    # memory beside the buffer when a server died mid-transfer)
    from groundswell.protocol.framing import _LEN, read_frame_into

    async def read():
        return await read_frame_into(_reader(_LEN.pack(1 << 20) + b"z" * 300_000, eof=True), 1 << 21, chunk=1 << 16)

    with pytest.raises(asyncio.IncompleteReadError) as ended:
        asyncio.run(read())
    assert ended.value.partial == b"" and ended.value.expected == 1 << 20
    assert "300000 bytes read on a total of 1048576" in str(ended.value)


def test_a_bulk_frame_that_stops_coming_ends_after_the_stall_bound_not_the_whole_timeout():
    from groundswell.protocol.framing import _LEN, FrameStalled, read_frame_into

    async def read(feed, stall_s=0.2, chunk=1 << 10) -> tuple[object, float]:
        reader = _reader()
        task = asyncio.create_task(feed(reader))
        started = time.monotonic()
        try:
            return await read_frame_into(reader, 1 << 20, chunk=chunk, stall_s=stall_s), time.monotonic() - started
        except Exception as exc:  # noqa: BLE001 (what the read raised is the result)
            return exc, time.monotonic() - started
        finally:
            task.cancel()

    async def nothing(reader):  # a reply, then not even the trailer's length
        await asyncio.sleep(10)

    async def some_then_nothing(reader):
        reader.feed_data(_LEN.pack(4096) + b"x" * 1500)
        await asyncio.sleep(10)

    async def trickle(reader):  # a byte well within the bound each time, a chunk never
        reader.feed_data(_LEN.pack(4096))
        for _ in range(200):
            reader.feed_data(b"x")
            await asyncio.sleep(0.02)

    async def steady(reader):  # a chunk every 0.1 s, each within the bound: the whole frame comes
        reader.feed_data(_LEN.pack(4096))
        for _ in range(4):
            await asyncio.sleep(0.1)
            reader.feed_data(b"y" * 1024)

    for feed, after in ((nothing, "before its length"), (some_then_nothing, "after 1500 bytes"),
                        (trickle, "after ")):
        got, took = asyncio.run(read(feed))
        assert isinstance(got, FrameStalled) and after in str(got), (feed.__name__, got)
        assert isinstance(got, ConnectionError) and not isinstance(got, TimeoutError)  # not "ran out of time"
        assert 0.15 < took < 1.0, (feed.__name__, took)
    got, took = asyncio.run(read(steady))
    assert bytes(got) == b"y" * 4096 and took >= 0.35  # slower than the bound in all, never stalled
    got, _ = asyncio.run(read(steady, stall_s=None))  # (no bound: as before, for other callers)
    assert bytes(got) == b"y" * 4096

    async def outer_timeout():  # an enclosing deadline is a timeout, as before: not a stall
        reader = _reader(_LEN.pack(4096))
        async with asyncio.timeout(0.1):
            await read_frame_into(reader, 1 << 20, stall_s=5.0)

    with pytest.raises(TimeoutError):
        asyncio.run(outer_timeout())


class _Writer:
    transport = None

    def write(self, data: bytes) -> None:
        pass

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        pass


class _P2P:
    """libp2p stood in for: each peer's stream delivers the frames its `serve` entry gives, then
    stays open and silent (a stalling server) unless it ends them."""

    def __init__(self, serve: dict[str, tuple[bytes, bool]]) -> None:
        self.serve = serve

    async def call_binary_stream_handler(self, target, name):
        data, ends = self.serve[target.to_base58()]
        return SimpleNamespace(addr="/ip4/10.0.0.1/tcp/1/p2p-circuit"), _reader(data, eof=ends), _Writer()


def _streams(p, round_id: int = 5):
    """A staller (its signed state reply, then nothing) and the coordinator (reply and blob), as
    libp2p streams; the staller's id and the records naming the state's hash."""
    from groundswell.protocol.envelope import seal
    from groundswell.protocol.framing import _LEN
    from groundswell.protocol.identity import Identity

    reply, blob, digest, good = _served_state(p, round_id=round_id)
    staller, coord = Identity.generate(), p.coordinator_id

    def frame(data: bytes) -> bytes:
        return _LEN.pack(len(data)) + data

    copied = StateReply(round_id, digest, reply.decision, len(blob), params_hash=good)  # its fields copied
    serve = {staller.peer_id: (frame(seal(staller, "unit", copied)), False),
             coord: (frame(seal(COORDINATORS[coord], "unit", reply)) + frame(bytes(blob)), True)}
    records = {pid: SimpleNamespace(round=round_id, params_hash=good, earlier_hashes=[]) for pid in (staller.peer_id, coord)}
    return serve, staller.peer_id, records


def _node(p, serve, records):
    from groundswell.protocol.identity import Identity
    from groundswell.protocol.transport import Transport

    async def refresh():
        return records

    return SimpleNamespace(transport=Transport(_P2P(serve), Identity.generate(), "unit"), cached_records=records,
                           refresh_records=refresh, rejoiner=None, direct_received=0,
                           guard=SimpleNamespace(count=lambda *a, **k: None))


def test_a_server_that_stalls_its_state_trailer_costs_the_stall_bound_and_is_not_our_slow_link(participant,
                                                                                             monkeypatch):
    """Found by a review (stall_stream): a server that sent its signed state reply and then nothing
    held the joiner for its whole time for one server (80 s at 25M parameters: the stream's trailer
    had no stall bound, the direct path's 20 s), and the joiner then said its own link was too slow
    for the run. Now the trailer stalls out like the direct path's, and a stall is no slow link."""
    from groundswell.peer import state_download
    from groundswell.protocol import transport
    from groundswell.protocol.transport import PeerGone, PeerUnavailable

    per_server = 3.0
    monkeypatch.setattr(transport, "TRAILER_STALL_S", 0.3, raising=False)
    monkeypatch.setattr(state_download, "state_timeout_s", lambda numel: per_server)
    monkeypatch.setattr(state_download, "state_reply_timeout_s", lambda numel: 1.0)
    monkeypatch.setattr(state_download, "sync_timeout_s", lambda numel: 3 * per_server + 1)
    p = participant
    serve, staller, records = _streams(p)
    node = _node(p, serve, records)

    async def sync(peers):
        started = time.monotonic()
        try:
            return await state_download.download_state(node, p.state_check(), peers, 0), time.monotonic() - started
        except PeerUnavailable as exc:
            return exc, time.monotonic() - started

    async def bulk():  # the transport's word for it: the peer stopped, not our time ran out
        return await node.transport.request_bulk(staller, "get-state", StateRequest(0), StateReply, timeout_s=1.0,
                                                 trailer_size=lambda r: r.size, trailer_timeout_s=lambda n: per_server)

    with pytest.raises(PeerGone, match="stalled"):
        asyncio.run(bulk())
    (state, via), took = asyncio.run(sync([staller, p.coordinator_id]))
    assert state.round == 5 and via == "stream"
    assert took < per_server / 2, took  # the staller cost its stall bound, not the per-server time
    refused, took = asyncio.run(sync([staller]))
    assert isinstance(refused, PeerUnavailable) and not isinstance(refused, state_download.StateTooSlow), refused
    assert took < per_server / 2, took
