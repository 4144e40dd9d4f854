"""The two processes of scripts/bench_state_sync.py: the server holds a state and serves it (the
peer's real `get-state` handler, and a raw stream for the baseline); the client downloads it each
way the parent asks for over a pipe and reports the times."""

from __future__ import annotations

import os
import socket
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from _procs import quiet_close, serve_commands
from groundswell.protocol.digests import bulk_hasher

RUN_ID = "bench"
RAW_HANDLER = "groundswell-bench/raw-state/1"


def _median_times(fn: Callable[[], Any], warmup: int, repeats: int,
                  check: Callable[[Any], None] | None = None) -> tuple[list[float], float | None]:
    """Run fn warmup + repeats times; (measured seconds, first warm-up seconds or None).
    `check(result)` runs after each call, outside the timed region."""
    first = None
    out = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        result = fn()
        dt = time.perf_counter() - t0
        if check is not None:
            check(result)
        del result
        if i < warmup:
            first = dt if first is None else first
        else:
            out.append(dt)
    return out, first


def _context(params: int, members: Sequence[str]) -> Any:
    from groundswell.compression import make_codec, segment_bounds, segment_size
    from groundswell.peer.run_state import RunContext

    numels = tuple(b - a for a, b in segment_bounds(params, segment_size(params, 16)))
    members = frozenset(members)  # a closed run: only its members join and read the state
    return RunContext(run_id=RUN_ID, min_peers=1, deadline_s=30.0, slack_s=5.0, max_shards=16,
                      segment_numels=numels, codec=make_codec("fp32"), max_payload_bytes=4 * params + (1 << 20),
                      allowlist=members, state_readers=members)


def _maxreply(params: int) -> int:
    return 16 * params + (1 << 20)


# --- server process ----------------------------------------------------------------------------

def _both_hashes(tensors: dict) -> str:
    """The parameters' and the momentum buffer's hashes: a download must bring both whole."""
    from groundswell.peer.run_state import params_hash

    return f"{params_hash(tensors['global_params'])}:{params_hash(tensors['momentum_buffer'])}"

class _Server:
    def __init__(self, conn: Any, tmp: str, params: int, seed: int, verbose: bool) -> None:
        import torch
        from groundswell.peer.run_state import GlobalState
        from groundswell.protocol.envelope import seal
        from groundswell.protocol.identity import Identity
        from groundswell.protocol.schema import Decision

        self.conn, self.tmp, self.params, self.verbose = conn, tmp, params, verbose
        self.identity_path = os.path.join(tmp, "server.key")
        self.identity = Identity.generate()
        self.identity.save(self.identity_path)
        me = self.identity.peer_id
        gen = torch.Generator().manual_seed(seed)
        tensors = {"global_params": torch.randn(params, generator=gen),
                   "momentum_buffer": torch.randn(params, generator=gen)}
        decision = seal(self.identity, RUN_ID, Decision(0, 0, "commit", [], [], [me], me, [], 0))
        self.state = GlobalState(round=1, tensors=tensors, decision=decision)  # cached: one object for all requests
        self.blob, self.digest = self.state.blob_and_digest()  # what _on_state serves (cached)
        self.expected_hash = _both_hashes(tensors)  # every tensor of the state, not the parameters alone
        self.node = None
        self._tcp: socket.socket | None = None
        self._tcp_thread: threading.Thread | None = None

    def info(self) -> dict:
        return {"peer_id": self.identity.peer_id, "state_bytes": len(self.blob), "digest": self.digest,
                "params_hash": self.expected_hash}

    # plain TCP ----------------------------------------------------------------------------------
    def tcp_listen(self) -> dict:
        srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", 0))
        srv.listen(4)
        self._tcp = srv
        blob = self.blob

        def serve() -> None:
            while True:
                try:
                    c, _ = srv.accept()
                except OSError:
                    return  # closed by tcp_stop
                with c:
                    try:
                        if c.recv(1):  # the request
                            c.sendall(blob)
                    except OSError:
                        pass

        self._tcp_thread = threading.Thread(target=serve, name="bench-tcp", daemon=True)
        self._tcp_thread.start()
        return {"port": srv.getsockname()[1]}

    def tcp_stop(self) -> dict:
        if self._tcp is not None:
            try:
                self._tcp.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._tcp.close()
            self._tcp = None
        if self._tcp_thread is not None:
            self._tcp_thread.join(10)
        return {}

    # the swarm node -------------------------------------------------------------------------------
    def p2p_start(self, members: list[str]) -> dict:
        from groundswell.peer.swarm import NodeOptions, SwarmNode
        from groundswell.protocol.framing import read_frame, write_frame

        self.node = SwarmNode(self.identity, self.identity_path, NodeOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
        self.node.start()
        child = getattr(getattr(self.node, "p2p", None), "_child", None)
        self.conn.send(("p2pd", child.pid if child is not None else None))  # so the parent can always end it
        self.node.attach(_context(self.params, members))
        state = self.state
        self.node.state_provider = lambda: state

        blob = self.blob  # bench-only handler (not part of the protocol): the bare stream

        async def raw(info: Any, reader: Any, writer: Any) -> None:
            try:
                await read_frame(reader, 4096)
                await write_frame(writer, blob)
            finally:
                writer.close()

        self.node.call(self.node.p2p.add_binary_stream_handler(RAW_HANDLER, raw), timeout_s=30)
        return {"maddrs": [m for m in self.node.maddrs if "/ip4/127.0.0.1/" in m]}

    def breakdown(self, repeats: int) -> dict:
        """Server-side cost (medians): serializing and hashing a state (once per state, then cached),
        sealing the small reply header (per request)."""
        from groundswell.protocol.envelope import seal
        from groundswell.protocol.schema import StateReply

        state, blob = self.state, self.blob
        header = StateReply(state.round, self.digest, state.decision, len(blob))
        med = lambda fn: statistics.median(_median_times(fn, 0, repeats)[0])
        arrays = [t.detach().cpu().contiguous().numpy() for t in state.tensors.values()]
        return {
            "serialize_s": med(state.to_blob),
            "hash_s": med(lambda: bulk_hasher().update(blob).hexdigest()),
            "seal_header_s": med(lambda: seal(self.identity, RUN_ID, header)),
            # For comparison: a raw layout (tensor bytes back to back, no zip container).
            "raw_concat_s": med(lambda: b"".join(a.tobytes() for a in arrays)),
        }

    def close(self) -> dict:
        self.tcp_stop()
        if self.node is not None:
            node, self.node = self.node, None
            quiet_close(node, self.verbose)
        return {}


# --- client process ----------------------------------------------------------------------------
class _Client:
    def __init__(self, conn: Any, tmp: str, params: int, verbose: bool) -> None:
        from groundswell.protocol.identity import Identity

        self.conn, self.tmp, self.params, self.verbose = conn, tmp, params, verbose
        self.identity_path = os.path.join(tmp, "client.key")
        self.identity = Identity.generate()
        self.identity.save(self.identity_path)
        self.node = None

    def tcp(self, port: int, size: int, warmup: int, repeats: int) -> dict:
        buf = bytearray(size)
        view = memoryview(buf)

        def once() -> None:
            with socket.create_connection(("127.0.0.1", port), timeout=600) as s:
                s.sendall(b"?")
                got = 0
                while got < size:
                    n = s.recv_into(view[got:], size - got)
                    if n == 0:
                        raise ConnectionError(f"TCP stream ended after {got} of {size} bytes")
                    got += n

        times, first = _median_times(once, warmup, repeats)
        return {"times": times, "first": first}

    def info(self) -> dict:
        return {"peer_id": self.identity.peer_id}

    def p2p_start(self, maddrs: list[str], members: list[str]) -> dict:
        from groundswell.peer.swarm import NodeOptions, SwarmNode

        self.node = SwarmNode(self.identity, self.identity_path,
                              NodeOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=list(maddrs)))
        self.node.start()
        child = getattr(getattr(self.node, "p2p", None), "_child", None)
        self.conn.send(("p2pd", child.pid if child is not None else None))
        self.node.attach(_context(self.params, members))
        return {}

    def p2p(self, server_id: str, digest: str, params_hash_expected: str, warmup: int, repeats: int,
            direct: bool = True) -> dict:
        """What a joiner does: `fetch_state` (the signed reply over libp2p, the sealed blob over a
        direct TCP connection), BLAKE3 check, map the tensors; timed as a whole and in parts. With
        `direct=False`, what a joiner that cannot reach the port does: the blob as the reply's trailer."""
        from groundswell.peer.run_state import GlobalState
        from groundswell.peer.state_fetch import fetch_state
        from groundswell.protocol.schema import ProtocolError, StateReply, StateRequest

        node, budget = self.node, _maxreply(self.params)
        parts: list[dict] = []

        def size(reply: StateReply) -> int:  # checked before a byte of the blob is read
            if reply.size > budget:
                raise ProtocolError(f"a state of {reply.size} bytes exceeds the limit of {budget}", reason="oversized")
            return reply.size

        def once() -> tuple[str, dict]:
            t0 = time.perf_counter()
            if direct:
                reply, blob, digest, via = node.call(fetch_state(node, server_id, 0, size, timeout_s=600), 660)
                if via != "direct":
                    raise RuntimeError(f"the state came by {via}, not over the direct connection")
            else:
                reply, blob, digest = node.call(node.transport.request_bulk(
                    server_id, "get-state", StateRequest(0), StateReply, timeout_s=600, trailer_size=size), 660)
            t1 = time.perf_counter()
            if not blob or digest != reply.digest:  # hashed while it arrived, inside request_bulk
                raise RuntimeError("state reply failed its hash check")
            t2 = time.perf_counter()
            tensors = GlobalState.tensors_from_blob(blob)
            t3 = time.perf_counter()
            parts.append({"request_s": t1 - t0, "hash_s": t2 - t1, "load_s": t3 - t2})
            return reply.digest, tensors

        def check(result: Any) -> None:  # not timed
            got_digest, tensors = result
            if got_digest != digest or _both_hashes(tensors) != params_hash_expected:
                raise RuntimeError("downloaded state differs from the served one")

        times, first = _median_times(once, warmup, repeats, check)
        return {"times": times, "first": first, "parts": parts[warmup:]}

    def raw(self, server_id: str, size: int, warmup: int, repeats: int, chunked: bool = False) -> dict:
        """The bare libp2p stream: one frame of `size` bytes, nothing else; read with the protocol's
        `read_frame` or (chunked) with `read_frame_into`."""
        from groundswell.protocol.framing import read_frame, read_frame_into, write_frame
        from hivemind.p2p import PeerID

        node = self.node

        async def fetch() -> int:
            _, reader, writer = await node.p2p.call_binary_stream_handler(PeerID.from_base58(server_id), RAW_HANDLER)
            try:
                await write_frame(writer, b"?")
                frame = await (read_frame_into if chunked else read_frame)(reader, size + 16)
                return len(frame)
            finally:
                writer.close()

        def once() -> None:
            got = node.call(fetch(), 660)
            if got != size:
                raise RuntimeError(f"raw stream gave {got} of {size} bytes")

        times, first = _median_times(once, warmup, repeats)
        return {"times": times, "first": first}

    def breakdown(self, params: int, seed: int, repeats: int) -> dict:
        """Client-side cost of one reply, piece by piece (medians), on a locally built header and blob."""
        import torch
        from groundswell.peer.run_state import GlobalState
        from groundswell.protocol.envelope import seal, unseal
        from groundswell.protocol.schema import Decision, StateReply

        me = self.identity.peer_id
        decision = seal(self.identity, RUN_ID, Decision(0, 0, "commit", [], [], [me], me, [], 0))  # as served
        gen = torch.Generator().manual_seed(seed)
        state = GlobalState(1, {"global_params": torch.randn(params, generator=gen),
                                "momentum_buffer": torch.randn(params, generator=gen)}, b"")
        blob = state.to_blob()
        sealed = seal(self.identity, RUN_ID, StateReply(1, bulk_hasher().update(blob).hexdigest(), decision, len(blob)))
        raw = b"".join(t.numpy().tobytes() for t in state.tensors.values())  # the raw layout, for comparison
        med = lambda fn: statistics.median(_median_times(fn, 0, repeats)[0])
        return {
            "unseal_header_s": med(lambda: unseal(sealed, RUN_ID, StateReply, sender=me)),
            "hash_s": med(lambda: bulk_hasher().update(blob).hexdigest()),
            "load_s": med(lambda: GlobalState.tensors_from_blob(blob)),
            "raw_frombuffer_s": med(lambda: torch.frombuffer(bytearray(raw), dtype=torch.float32)),
        }

    def close(self) -> dict:
        if self.node is not None:
            node, self.node = self.node, None
            quiet_close(node, self.verbose)
        return {}


def worker_main(role: str, conn: Any, tmp: str, params: int, seed: int, verbose: bool) -> None:
    import logging

    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format=f"[{role}] %(levelname)s %(name)s: %(message)s")
    import torch

    torch.set_num_threads(1)
    serve_commands(lambda: _Server(conn, tmp, params, seed, verbose) if role == "server" else
                   _Client(conn, tmp, params, verbose), conn, role)
