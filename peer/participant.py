"""A participant of a run: the model, the outer optimizer's global state, the network node, and
the checkpoints. The volunteer (`join`) and the coordinator (`launch`) are both participants;
the volunteer trains and contributes, the coordinator follows every round and serves.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path
from typing import Any

import torch
from groundswell.compression import RobustOptions, make_codec, segment_bounds, segment_size
from groundswell.optim import (
    DiLoCo,
    DiLoCoConfig,
    OuterOptimizer,
    SparseLoCo,
    SparseLoCoConfig,
    copy_into_parameters,
    parameters_to_vector,
)
from groundswell.protocol.client import RoundBehind
from groundswell.protocol.context import contribution_bound
from groundswell.protocol.envelope import seal
from groundswell.protocol.guard import Limits
from groundswell.protocol.identity import Identity
from groundswell.protocol.schema import Decision, ProtocolError

from .batches import evaluate, heldout_batches
from .catch_up import catch_up_view, first_decision, holders_to_ask
from .data import Corpus, load_corpus
from .dht_rejoin import load_known_peers
from .event_log import EventLog
from .manifest import RunManifest, SignedManifest
from .participant_checkpoints import KNOWN_PEERS_FILE, Checkpoints
from .run_state import GlobalState, RunContext, state_hash
from .scoring import ContributionScorer
from .state_download import download_state, sync_timeout_s
from .state_files import remove_half_written, write_atomically
from .state_trust import (
    EARLIER_HASHES,
    StateCheck,
    record_hashes,
    state_servers,
    vouchers_of,
)
from .swarm import NodeOptions, SwarmNode
from .work_file import CONTRIBUTED_FILE, contributed_bytes, contributed_marker, read_contributed
from .workload import Workload, build_workload, check_layout

log = logging.getLogger(__name__)


def make_outer(manifest: RunManifest, params: Any, numel: int) -> OuterOptimizer:
    """The run's outer optimizer over `params`, segmented for up to `max_shards` shards."""
    o = manifest.outer
    opts = {"chunk": o.chunk, "k": o.topk} if o.codec_name == "sparseloco" else {}
    codec = make_codec(o.codec_name, **opts)
    segment = segment_size(numel, manifest.round.max_shards)
    if o.algorithm == "sparseloco":
        config = SparseLoCoConfig(lr=o.lr_value, error_decay=o.error_decay, eager=bool(o.overlap and o.eager))
        return SparseLoCo(params, codec, config, segment)
    if o.algorithm == "diloco":
        return DiLoCo(params, codec, DiLoCoConfig(lr=o.lr_value, momentum=o.momentum), segment)
    raise ValueError(f"outer.algorithm {o.algorithm!r} cannot run in a swarm")


def run_context(manifest: RunManifest, outer: OuterOptimizer, coordinator: str = "") -> RunContext:
    """The round protocol's view of the run."""
    numel = outer.global_params.numel()
    numels = tuple(b - a for a, b in segment_bounds(numel, outer.segment))
    # A contribution's most bytes: its segments' encodings, with room for the message around them.
    budget = contribution_bound(outer.codec, numels)
    allow = frozenset(manifest.run.allowlist) if not manifest.run.open else None
    d = manifest.defences
    readers = None if allow is None or manifest.run.open_state else allow | {coordinator}
    return RunContext(manifest.run.id, manifest.run.min_peers, manifest.round.deadline_s, manifest.round.slack_s,
                      manifest.round.max_shards, numels, outer.codec, budget, allow,
                      RobustOptions(clip=d.clip, trim=d.trim),
                      Limits(requests_per_s=d.requests_per_s, max_streams=d.max_streams, ban_s=d.ban_s,
                             strikes=d.strikes, max_clock_skew_s=d.max_clock_skew_s), readers, d.verify_aggregates,
                      manifest.round.replicas, coordinator)


def genesis_decision(identity: Identity, run_id: str) -> bytes:
    """The signed decision of round -1: the coordinator alone serves round 0."""
    d = Decision(-1, 0, "commit", [], [], [identity.peer_id], identity.peer_id, [], 0, time.time())
    return seal(identity, run_id, d)


class Participant(Checkpoints):
    """Model + outer optimizer + node + checkpoints for one process in a run."""

    def __init__(self, manifest: RunManifest, signed_manifest: bytes, identity: Identity, identity_path: str,
                 options: NodeOptions, state_dir: Path | None, device: str = "cpu",
                 corpus: Corpus | None = None, node: SwarmNode | None = None,
                 workload: Workload | None = None) -> None:
        self.manifest = manifest
        self.identity = identity
        self.device = device
        self.state_dir = state_dir
        self.work_token: str | None = None  # names the contribution in flight in work.pt (see work_file)
        self.work_recorded = True  # False: work.pt could not be written for it (then it is not sent)
        if state_dir is not None:
            state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # private: a closed run's weights
            remove_half_written(state_dir)
        self.events = EventLog(state_dir / "events.jsonl" if state_dir else None)
        self.corpus = corpus or load_corpus(manifest.data.source)
        # (`launch` hands in the one it built to sign its layout: not built twice)
        self.workload: Workload = workload or build_workload(manifest.model.spec, self.corpus.vocab_size,
                                                             manifest.run.seed)
        check_layout(manifest, self.workload)  # before anything is downloaded or sent
        self.workload.model.to(device)
        numel = sum(p.numel() for p in self.workload.model.parameters())
        self.outer = make_outer(manifest, self.workload.model.parameters(), numel)
        coordinator = SignedManifest.from_bytes(signed_manifest).coordinator if signed_manifest else ""
        self.coordinator_id = coordinator
        self.ctx = run_context(manifest, self.outer, coordinator)
        self.evalset = heldout_batches(self.corpus, self.workload.block_size, manifest.eval.batch_size,
                                       manifest.eval.batches)
        self.node = node or SwarmNode(identity, identity_path, options)
        self.node.signed_manifest = signed_manifest
        if coordinator:
            self.node.rejoiner.vouch([coordinator])  # dialled first (after bootstrap peers) to get back into the DHT
        self._snapshot: GlobalState | None = None
        self._preloaded: tuple[dict[str, Any] | None] | None = None  # see preload_checkpoint
        self._damaged: set[Path] = set()  # checkpoints the loader found damaged: never kept in their place
        self._unreadable: set[Path] = set()  # checkpoints it could not read (EIO, EACCES): kept, never counted
        self.last_checkpoint: Path | None = None  # the newest this process wrote (told to the user on leaving)
        self.data_seed: int | None = None  # a volunteer's data order: None, from the run's seed and our id
        self.last_save_failed = False  # the latest try to write one failed (last_checkpoint is older)
        self.hash_history: dict[int, str] = {}  # round -> hash of the global parameters it started from
        self._marker_lock = threading.Lock()  # contributed.json's writers (see _remember_contribution)
        self._marker_written: tuple[int, int] | None = None  # the (round, attempt) it names, as this process wrote it
        self.node.state_provider = lambda: self._snapshot
        self.scorer = ContributionScorer(manifest, self.corpus, device) if manifest.defences.scoring else None

    # --- network --------------------------------------------------------------------------------
    def start_network(self) -> None:
        """Start the node (if not yet) and join the run's protocol."""
        if self.node.ctx is None:
            if self.state_dir is not None:  # before the first heartbeat, whose DHT re-entry dials them
                self.node.rejoiner.restore(load_known_peers(self.state_dir / KNOWN_PEERS_FILE))
            if not self.node._thread.is_alive():
                self.node.start()
            self.node.attach(self.ctx)
            client = self.node.client
            assert client is not None
            client.contributed.update(self._contributed_before())
            client.on_contribute = self._remember_contribution
            if self.scorer is not None:
                self.node.server.score = self._score  # type: ignore[union-attr]
                self.node.server.score_threshold = self.manifest.defences.score_threshold  # type: ignore[union-attr]

    def _contributed_before(self) -> dict[int, int]:
        """The last (round, attempt) an earlier process with this state dir contributed to: a
        restarted peer sends nothing to that attempt again (aggregators would refuse it)."""
        return contributed_marker(read_contributed(self.state_dir)) if self.state_dir else {}  # torn: afresh

    def _remember_contribution(self, round_id: int, attempt: int) -> bool:
        """Persist the attempt we are about to contribute to (before anything is sent); False if
        it cannot be (disk full, read-only dir): then nothing is sent."""
        if self.state_dir is None:
            return True
        if not self.work_recorded:  # sent now, a crash before the next checkpoint would drop its work
            log.error("could not record the work of round %d's contribution: not sending it; training goes on",
                      round_id)
            self.events.write("contribution-not-recorded", round=round_id, error="work.pt not written",
                              peer=self.identity.peer_id)
            return False
        try:
            # Durable before anything is sent: after a power loss, a second contribution to the
            # same attempt would cost us an equivocation strike at every aggregator, and a restart
            # from an older checkpoint must know this work went out (or it sends it again). So a
            # failed directory sync is a failed record here (the file, in place, names an attempt
            # never sent: a restart takes it as counted, which loses work rather than doubling it).
            # One writer at a time, never going back: a worker thread still writing a given-up
            # attempt's marker (its fsync slow) could otherwise rename last and name the older one.
            with self._marker_lock:
                if self._marker_written is not None and (round_id, attempt) <= self._marker_written:
                    raise OSError(f"a newer contribution than round {round_id} attempt {attempt} is recorded")
                content = contributed_bytes(round_id, attempt, self.work_token)
                write_atomically(self.state_dir / CONTRIBUTED_FILE, lambda f: f.write(content), durable=True)
                self._marker_written = (round_id, attempt)
        except OSError as exc:
            log.error("could not record the contribution (%s): not sending it; training goes on", exc)
            self.events.write("contribution-not-recorded", round=round_id, error=str(exc), peer=self.identity.peer_id)
            return False
        return True

    async def _score(self, round_id: int, updates: dict[str, torch.Tensor]) -> dict[str, float]:
        """Score contributions as the round's leader (in a worker thread: the loop keeps serving)
        against the parameters they were made from: the published state of their round."""
        scorer = self.scorer
        assert scorer is not None
        # Not `outer.global_params`: the training thread moves those on, and a leader that applies
        # rounds late (overlap), or is still fetching the round before, would score this round's
        # updates from the wrong parameters (found by a review). Without them, no scores: the
        # decision commits unscored, and says why.
        snap = self._snapshot
        if snap is None or snap.round != round_id:
            raise RuntimeError(f"the parameters of round {round_id} are not at hand here (published: "
                               f"{'none' if snap is None else f'round {snap.round}'})")
        params = snap.tensors["global_params"]

        def score() -> dict[str, float]:  # (the copy too: 100 MB at 25M parameters would stall the loop)
            return scorer(params.detach().cpu().clone(), updates, cancelled)

        cancelled = threading.Event()
        try:
            scores = await asyncio.to_thread(score)
        except asyncio.CancelledError:  # past the deadline, or closing: the thread stops at the next update
            cancelled.set()
            raise
        self.events.write("scores", round=round_id, scores=scores, threshold=self.manifest.defences.score_threshold,
                          peer=self.identity.peer_id)
        return scores

    def snapshot(self) -> None:
        """Publish the current global state for joiners and refresh this peer's DHT record."""
        state = self._global_state()
        if state is None:
            return
        r, digest = state.round, state.state_digest()
        self._snapshot = state
        self.hash_history[r] = digest
        for old in [k for k in self.hash_history if k < r - 32]:
            del self.hash_history[old]
        # The record also lists our hashes of the last rounds before this one: a joiner checks a
        # state of one of them against the coordinator's word, or (none for that round) its
        # vouchers' or the majority's, even when rounds are quicker than the heartbeat.
        before = sorted(k for k in self.hash_history if k < r)[-EARLIER_HASHES:]
        earlier = [f"{k}:{self.hash_history[k]}" for k in before]
        self.node.update_record(round=r, params_hash=digest, earlier_hashes=earlier)

    def _global_state(self) -> GlobalState | None:
        """The shared outer state as it is now, with the commit it follows (None if this book
        does not hold that commit)."""
        book = self.node.book
        r = self.outer.round_id
        entry = book.committed.get(r - 1) if book is not None else None
        if entry is None:
            return None
        tensors = {"global_params": self.outer.global_params.detach().cpu().clone()}
        if isinstance(self.outer, DiLoCo):
            tensors["momentum_buffer"] = self.outer.momentum_buffer.detach().cpu().clone()
        digest = state_hash(entry[0], tensors["global_params"], tensors.get("momentum_buffer"))
        return GlobalState(r, tensors, entry[0], _state_hash=digest)

    def outer_hash(self) -> str:
        """`state_hash` of this peer's shared outer state now (what its record publishes); "" if
        our book lacks the commit it came from (never after a sync, a catch-up or a round)."""
        entry = self.node.book.committed.get(self.outer.round_id - 1) if self.node.book is not None else None
        if entry is None:
            log.warning("round %d: the commit before it is not in our book; its state hash is not known",
                        self.outer.round_id)
            return ""
        momentum = self.outer.momentum_buffer if isinstance(self.outer, DiLoCo) else None
        return state_hash(entry[0], self.outer.global_params, momentum)

    def load_global(self, state: GlobalState) -> None:
        """Adopt a downloaded or checkpointed global state; local progress is rebased onto it."""
        g = state.tensors["global_params"]
        if g.shape != self.outer.global_params.shape:
            raise ProtocolError(f"state has {g.numel()} parameters, the model has {self.outer.global_params.numel()}")
        self.node.record_decision(state.decision, supersede=state.supersedes)  # first: a conflicting one changes nothing
        if self.outer.pending is not None:
            self.outer.apply(None)
        sd = {"round_id": state.round, "global_params": g, **self._extra_state(state)}
        local = self.outer.local_vector()
        progress = local - self.outer.global_params
        self.outer.load_state_dict(sd)
        copy_into_parameters(self.outer.global_params + progress, self.outer.params)
        # Our hashes of earlier rounds belong to the trajectory just left (maybe the wrong one that
        # sent us re-syncing): compared with a lagging record they would send us re-syncing again.
        self.hash_history.clear()
        self.snapshot()

    def _extra_state(self, state: GlobalState) -> dict[str, Any]:
        if isinstance(self.outer, DiLoCo):
            return {"algorithm": "diloco", "momentum_buffer": state.tensors.get(
                "momentum_buffer", torch.zeros_like(state.tensors["global_params"]))}
        assert isinstance(self.outer, SparseLoCo)
        return {"algorithm": "sparseloco", "error": self.outer.error.cpu()}  # error feedback stays ours

    def state_check(self) -> StateCheck:
        """The checks a state downloaded by this peer must pass."""
        vouchers = None
        if self.identity.peer_id == self.coordinator_id and self.ctx.allowlist is None and self.node.book is not None:
            vouchers = vouchers_of(self.node.book.committed)  # see vouchers_of: sybils cannot outvote them
        book = self.node.book
        return StateCheck(self.ctx, self.identity.peer_id, self.coordinator_id, self.outer.global_params.numel(),
                          needs_momentum=isinstance(self.outer, DiLoCo), vouchers=vouchers,
                          known_commit=book.committed.get if book is not None else lambda _round: None)

    def sync_state(self, bootstrap_peers: list[str], min_round: int = -1) -> None:
        """Download the newest global state from peers (records first, then bootstrap peers)."""
        async def peers_to_ask() -> list[str]:
            return state_servers(await self.node.refresh_records(), self.identity.peer_id, bootstrap_peers,
                                 self.coordinator_id)

        peers = self.node.call(peers_to_ask(), timeout_s=30)
        state, via = self.node.call(download_state(self.node, self.state_check(), peers, min_round),
                                    timeout_s=sync_timeout_s(self.outer.global_params.numel()))
        self.load_global(state)
        self.events.write("sync", round=state.round, hash=self.outer_hash(), via=via,
                          peer=self.identity.peer_id)

    def fresh_records(self) -> dict[str, Any]:
        """The peer records, looked up now (those cached if the lookup times out: a slow DHT says
        nothing of whether we are behind, and taking it for that downloaded the whole state of
        our own round)."""
        try:
            return self.node.call(self.node.refresh_records(), timeout_s=30)
        except TimeoutError:
            log.info("the records lookup timed out; going by the records cached")
            return self.node.cached_records

    def catch_up(self, fresh: bool = True) -> int:
        """Apply rounds the swarm committed that this peer did not take part in; returns how many.
        `fresh=False`: judge from the records cached by the last refresh and start the next one in
        the background (after a normal round: training does not wait for a DHT lookup)."""
        applied = 0
        if fresh:
            records = self.fresh_records()
        else:
            records = self.node.cached_records
            self.node.refresh_in_background()
        view = catch_up_view(records, self.identity.peer_id, self.coordinator_id)
        client = self.node.client
        assert client is not None and self.node.server is not None
        keep, swarm_round = self.node.server.keep_rounds, view.swarm_round
        book = self.node.book
        # A commit of our round already in our book (a leader or aggregator that said the round
        # was over handed it over) says we are behind, whatever the records, which lag a heartbeat
        # or more: a joiner whose records showed no newer round stayed a round behind for good.
        while self.outer.round_id < view.target or (book is not None and self.outer.round_id in book.committed):
            r = self.outer.round_id
            known = book.committed.get(r) if book is not None else None
            ask = [] if known is not None else holders_to_ask(view, self.node.holders(r), self.coordinator_id)
            signed = known[0] if known is not None else (
                self.node.call(first_decision(client, ask, r), timeout_s=30) if ask else b"")
            if not signed:
                if swarm_round - r > keep:
                    # Peers forget a round's decision and aggregate after `keep` rounds: this peer
                    # would wait at its round for good (it did, after a long network outage).
                    raise RoundBehind(f"the swarm is at round {swarm_round}, {swarm_round - r} rounds ahead of us, "
                                      f"and peers keep {keep} rounds of aggregates: taking the state instead")
                break
            mean = self.node.call(client.fetch_aggregate(signed), timeout_s=600)
            self.outer.follow(r, mean)
            self.snapshot()
            # the hash of a round applied in catching up counts in the run's agreement like any other
            self.events.write("follow", round=r, hash=self.hash_history.get(self.outer.round_id),
                              eval_loss=self._eval_if_due(r), peer=self.identity.peer_id)
            applied += 1
        return applied

    def agrees_with_swarm(self, vacuous: bool = True) -> bool:
        """False if the coordinator's published hash (else most peers'), for a round this peer also
        went through, differs from this peer's own hash of that round (it then re-syncs).
        `vacuous`: the answer where no record shares a round with ours (nothing compared)."""
        records = self.node.cached_records
        signer = records.get(self.coordinator_id)
        word = record_hashes(signer) if self.coordinator_id != self.identity.peer_id else {}
        shared = [r for r in word if r in self.hash_history]
        if shared:  # the coordinator's word, where it has one, decides (as when a state is downloaded)
            return word[max(shared)] == self.hash_history[max(shared)]
        comparable = [r.params_hash == self.hash_history[r.round] for pid, r in records.items()
                      if pid != self.identity.peer_id and r.round in self.hash_history and r.params_hash]
        return vacuous if not comparable else sum(comparable) * 2 >= len(comparable)

    # --- evaluation and checkpoints ---------------------------------------------------------------
    def _eval_if_due(self, r: int) -> float | None:
        """The coordinator's held-out loss after round `r` where the run evaluates that round
        (as after a round it took part in: a round caught up on used to go unevaluated, and the
        run's loss curve had holes where the coordinator had fallen behind); else None."""
        if self.identity.peer_id != self.coordinator_id or (r + 1) % self.manifest.eval.every_rounds:
            return None
        loss = self.eval_global()
        if loss == loss:
            self.node.update_record(loss=loss, loss_round=r)
        return loss

    def eval_global(self) -> float:
        """Held-out loss of the global parameters (evaluated on a scratch copy of the model)."""
        model = self.workload.model
        saved = parameters_to_vector(model.parameters()).detach().clone()
        copy_into_parameters(self.outer.global_params, list(model.parameters()))
        try:
            return evaluate(model, self.workload.loss_fn, self.evalset, device=self.device)
        finally:
            copy_into_parameters(saved, list(model.parameters()))
