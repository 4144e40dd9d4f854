"""A node uploads its state to a bounded number of peers at once over streams, one upload per
requester; the rest are told it is busy, and a slot is freed once its upload is over."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch
from groundswell.peer.state_serving import KEPT_FOR_CONTRIBUTORS, MAX_UPLOADS, UploadSlots
from groundswell.protocol.schema import StateReply, StateRequest
from groundswell.protocol.transport import WithTrailer


def test_upload_slots_are_bounded_one_per_requester_and_freed_once():
    slots = UploadSlots(total=2, kept=0)
    a, b = slots.take("a"), slots.take("b")
    assert a is not None and b is not None and slots.in_use == 2
    assert slots.take("c") is None and slots.take("a") is None and slots.refused == 2
    a()
    a()  # freeing twice frees one slot, not someone else's
    c = slots.take("c")
    assert c is not None and slots.in_use == 2 and slots.take("a") is None
    b()
    again = slots.take("b")
    b()  # an old release of "b" does not free its new upload
    assert again is not None and slots.in_use == 2
    with pytest.raises(ValueError):
        UploadSlots(total=0)
    with pytest.raises(ValueError):
        UploadSlots(total=2, kept=2)


def test_kept_slots_go_only_to_requesters_the_node_vouches_for():
    slots = UploadSlots(total=3, kept=1)
    s1, s2 = slots.take("s1"), slots.take("s2")
    assert s1 is not None and s2 is not None
    assert slots.take("s3") is None  # strangers (fresh identities cost nothing) get two of three
    vet = slots.take("vet", vouched=True)
    assert vet is not None and slots.take("vet2", vouched=True) is None and slots.in_use == 3
    vet()
    assert slots.take("s3") is None  # the kept slot stays kept when it frees
    assert slots.take("vet", vouched=True) is not None
    s1()  # a stranger's slot frees: a vouched peer may take it too, and then strangers wait
    assert slots.take("vet3", vouched=True) is not None and slots.in_use == 3
    s2()
    assert slots.take("s4") is not None and slots.in_use == 3


VET = "12D3KooWvet"  # a contributor in a commit the node holds


@pytest.fixture
def node():
    import time

    from groundswell.peer.run_state import GlobalState
    from groundswell.peer.swarm import NodeOptions, SwarmNode
    from groundswell.protocol.context import DecisionBook
    from groundswell.protocol.envelope import seal
    from groundswell.protocol.identity import Identity
    from groundswell.protocol.schema import Decision

    me = Identity.generate()
    n = SwarmNode(me, "unused", NodeOptions())  # only its handler is used: never started
    n.book = DecisionBook("unit")
    commit = seal(me, "unit", Decision(2, 0, "commit", [VET], [VET], [me.peer_id], me.peer_id, [], 0, time.time()))
    n.book.add(commit)
    n.state_provider = lambda: GlobalState(3, {"global_params": torch.arange(1000, dtype=torch.float32)}, commit)
    try:
        yield n
    finally:
        n._loop.close()


def test_a_node_serving_as_many_uploads_as_it_takes_answers_busy_and_frees_slots_as_uploads_end(node):
    async def ask(sender: str, direct: bool = False):
        return await node._on_state(sender, StateRequest(0, direct=direct))

    async def scenario() -> None:
        open_slots = MAX_UPLOADS - KEPT_FOR_CONTRIBUTORS
        uploads = [await ask(f"joiner{i}") for i in range(open_slots)]
        assert all(isinstance(u, WithTrailer) and u.trailer and u.release is not None for u in uploads)
        assert uploads[0].reply.size == len(uploads[0].trailer) and not uploads[0].reply.busy
        for sender in ("joiner0", "late"):  # one more upload to the same requester, or to a stranger
            busy = await ask(sender)
            assert isinstance(busy, StateReply) and busy.busy and busy.size == 0
        assert node.guard.rejected["busy:get-state"] == 2
        vet = await ask(VET)  # a contributor in our commits gets the slot kept for such peers
        assert isinstance(vet, WithTrailer) and vet.trailer and vet.release is not None
        uploads.append(vet)
        assert node.uploads.in_use == MAX_UPLOADS
        # the direct port bounds its own downloads: a ticket needs no stream upload slot
        offered_to: list[str] = []
        node.direct = SimpleNamespace(port=4242, offer=lambda blob, requester, vouched: offered_to.append(
            requester) or (b"t" * 32, b"k" * 32))
        ticket = await ask("late", direct=True)
        assert isinstance(ticket, WithTrailer) and ticket.trailer == b"" and ticket.reply.direct_port == 4242
        assert offered_to == ["late"]  # the ticket is the requester's: a newer one replaces it
        assert ticket.release is None
        node.direct = None
        uploads[1].release()
        again = await ask("late")
        assert isinstance(again, WithTrailer) and again.trailer and not again.reply.busy
        # a state older than asked for is "nothing newer", not "busy"
        older = await node._on_state("other", StateRequest(9))
        assert isinstance(older, StateReply) and older.size == 0 and not older.busy

    asyncio.run(scenario())
    assert node.uploads.in_use == MAX_UPLOADS


def test_a_direct_request_past_the_tickets_open_to_it_goes_over_the_stream_or_is_answered_busy(node, monkeypatch):
    # a direct get-state takes no upload slot, and a full ticket table used to push out its oldest
    # ticket (a joiner's, not yet redeemed): now the state goes over the stream if an upload slot
    # is free (a review of that fix: "busy" alone refused joiners a free stream), else busy; and
    # contributors keep a share of the tickets
    from groundswell.peer.state_serving import UploadSlots
    from groundswell.protocol import direct
    from groundswell.protocol.direct import DirectServer

    monkeypatch.setattr(direct, "MAX_TICKETS", 3)
    monkeypatch.setattr(direct, "TICKETS_KEPT_FOR_CONTRIBUTORS", 1)
    node.uploads = UploadSlots(total=2, kept=1)  # one stream upload for strangers

    async def ask(sender: str):
        return await node._on_state(sender, StateRequest(0, direct=True))

    async def scenario() -> list:
        node.direct = DirectServer()
        await node.direct.start("127.0.0.1")  # (a server not listening, or closed, hands out no ticket)
        try:
            return [await ask(sender) for sender in ("joiner0", "joiner1", "late", VET, "late2")]
        finally:
            await node.direct.close()

    replies = asyncio.run(scenario())
    tickets = [isinstance(r, WithTrailer) and len(r.reply.direct_token) == 32 for r in replies]
    assert tickets == [True, True, False, True, False]
    streamed = replies[2]
    assert isinstance(streamed, WithTrailer) and streamed.reply.direct_port == 0 and len(streamed.trailer) > 0
    assert isinstance(replies[4], StateReply) and replies[4].busy and replies[4].size == 0
    assert node.guard.rejected["busy:get-state"] == 1
    assert node.uploads.in_use == 1  # the streamed one, until its trailer is written


@pytest.mark.parametrize("step", ["blob_and_digest", "state_digest"])
def test_a_slot_is_freed_when_building_the_reply_fails(node, step):
    def broken():
        raise RuntimeError("disk gone")

    state = node.state_provider()
    setattr(state, step, broken)
    node.state_provider = lambda: state
    with pytest.raises(RuntimeError, match="disk gone"):
        asyncio.run(node._on_state("joiner", StateRequest(0)))
    assert node.uploads.in_use == 0


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_joiners_past_the_upload_slots_are_told_busy_and_all_get_the_state(tmp_path, monkeypatch):
    """Real nodes, the direct port off: five joiners ask at once, the server uploads to two at a
    time (its blob build slowed, so the first two hold their slots a while); the rest are told it
    is busy, ask again, and all end with the server's state; every slot is free after."""
    import threading
    import time

    from groundswell.compression import make_codec
    from groundswell.peer import state_download, state_trust
    from groundswell.peer.run_state import GlobalState, RunContext
    from groundswell.peer.swarm import NodeOptions, SwarmNode
    from groundswell.protocol.envelope import seal
    from groundswell.protocol.identity import Identity
    from groundswell.protocol.schema import Decision

    numel = 1 << 20
    monkeypatch.setattr(state_download, "BUSY_WAIT_S", 0.2)
    ids = [Identity.generate() for _ in range(6)]
    for i, ident in enumerate(ids):
        ident.save(tmp_path / f"{i}.key")
    ctx = RunContext("unit", 1, 5.0, 1.0, 1, (numel,), make_codec("sparseloco"), 4 * numel + 4096)
    nodes: list[SwarmNode] = []
    try:
        server = SwarmNode(ids[0], str(tmp_path / "0.key"), NodeOptions(direct_state=False, reachability="public"))
        nodes.append(server)
        server.start()
        server.attach(ctx)
        genesis = seal(ids[0], "unit", Decision(-1, 0, "commit", [], [ids[0].peer_id], [ids[0].peer_id],
                                                ids[0].peer_id, [], 0, time.time()))
        params = torch.randn(numel)
        state = GlobalState(0, {"global_params": params}, genesis)
        built = state.blob_and_digest

        def slowly_built():
            time.sleep(1.0)
            return built()

        state.blob_and_digest = slowly_built
        server.state_provider = lambda: state
        server.uploads = UploadSlots(total=2, kept=0)
        boot = [m for m in server.maddrs if "/ip4/127.0.0.1/" in m]
        joiners = []
        for i in range(1, 6):
            node = SwarmNode(ids[i], str(tmp_path / f"{i}.key"),
                             NodeOptions(initial_peers=boot, direct_state=False, reachability="public"))
            nodes.append(node)
            node.start()
            node.attach(ctx)
            joiners.append(node)
        got: dict[int, object] = {}

        def sync(i: int, node: SwarmNode) -> None:
            check = state_trust.StateCheck(ctx, node.identity.peer_id, ids[0].peer_id, numel, needs_momentum=False)
            try:
                got[i] = node.call(state_download.download_state(node, check, [ids[0].peer_id], -1), timeout_s=120)[0]
            except Exception as exc:  # noqa: BLE001 - reported by the assert below
                got[i] = exc

        threads = [threading.Thread(target=sync, args=(i, n)) for i, n in enumerate(joiners)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(150)
        assert all(isinstance(got.get(i), GlobalState) for i in range(5)), got
        assert all(torch.equal(got[i].tensors["global_params"], params) for i in range(5))
        assert server.guard.rejected["busy:get-state"] >= 1
        end = time.monotonic() + 20
        while server.uploads.in_use and time.monotonic() < end:
            time.sleep(0.1)
        assert server.uploads.in_use == 0
    finally:
        for node in reversed(nodes):
            node.close()


def test_requesters_of_a_state_wait_for_its_one_build_on_the_loop_not_in_worker_threads(node, monkeypatch):
    """Found by a review: each requester of a new snapshot waited for its build in a worker thread
    of its own, and with a few joiners at once the node's pool (the one round work runs in) was
    full of threads waiting on a lock. The state hash was computed on the event loop too."""
    import threading
    import time

    from groundswell.peer.run_state import GlobalState

    state = node.state_provider()
    node.state_provider = lambda: state
    entered: list[int] = []
    real = GlobalState.blob_and_digest

    def slow_blob_and_digest(self):
        entered.append(threading.get_ident())
        if self._blob is None:
            time.sleep(0.3)  # packing and hashing a large model
        return real(self)

    monkeypatch.setattr(GlobalState, "blob_and_digest", slow_blob_and_digest)

    async def scenario() -> list:
        loop_thread = threading.get_ident()
        replies = await asyncio.gather(*(node._on_state(f"joiner{i}", StateRequest(0)) for i in range(3)))
        workers = {t for t in entered if t != loop_thread}
        assert len(workers) == 1, f"{len(workers)} worker threads took part in one build"
        return replies

    replies = node._loop.run_until_complete(scenario())
    assert all(isinstance(r, WithTrailer) and r.trailer == replies[0].trailer for r in replies)
    assert state.built()
    for r in replies:
        r.release()
