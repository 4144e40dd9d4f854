"""Outer optimizers: one round by hand, state round trips, and contributions that must not be lost."""

from __future__ import annotations

import pytest
import torch
from groundswell.compression import CodecError, Payload, make_codec
from groundswell.compression.base import mean_of_decoded
from groundswell.optim import DiLoCo, DiLoCoConfig, InProcessHub, RoundFailed, SparseLoCo, SparseLoCoConfig


class KeepLargest:
    """A tiny lossy test codec: keeps only the largest-magnitude entry (exact in fp32)."""

    name = "fp32"  # travels in an fp32-shaped envelope so the hub's strict decode accepts it

    def __init__(self) -> None:
        self.inner = make_codec("fp32")

    def encode(self, x: torch.Tensor) -> Payload:
        kept = torch.zeros_like(x)
        i = int(x.abs().argmax())
        kept[i] = x[i]
        return self.inner.encode(kept)

    def decode(self, payload, device=None):
        return self.inner.decode(payload, device=device)

    def validate(self, payload) -> None:
        self.inner.validate(payload)

    def aggregate(self, payloads, device=None):
        return mean_of_decoded(self, payloads, device)


def _model(values: list[float]) -> torch.nn.Linear:
    m = torch.nn.Linear(len(values), 1, bias=False)
    with torch.no_grad():
        m.weight.copy_(torch.tensor([values]))
    return m


def _set(model: torch.nn.Module, values: list[float]) -> None:
    with torch.no_grad():
        model.weight.copy_(torch.tensor([values]))


def _weights(model: torch.nn.Module) -> list[float]:
    return model.weight.detach().flatten().tolist()


def _round(outers, hub, drop=()):
    r = outers[0].round_id
    hub.drop = {(r, w) for w in drop}
    eps = [hub.endpoint(f"w{i}") for i in range(len(outers))]
    for ep, o in zip(eps, outers):
        ep.contribute(o.round_id, o.prepare())
    results = []
    for ep, o in zip(eps, outers):
        try:
            res = ep.collect(o.round_id)
        except RoundFailed:
            res = None
        o.apply(res)
        results.append(res)
    return results


def test_diloco_one_round_by_hand():
    models = [_model([1.0, 2.0]), _model([1.0, 2.0])]
    codec = make_codec("fp32")
    outers = [DiLoCo(m.parameters(), codec, DiLoCoConfig(lr=0.7, momentum=0.9)) for m in models]
    hub = InProcessHub(codec, ["w0", "w1"])
    _set(models[0], [0.5, 2.5])  # delta w0 = [0.5, -0.5]
    _set(models[1], [1.5, 1.0])  # delta w1 = [-0.5, 1.0]
    res = _round(outers, hub)
    # mean = [0, 0.25]; m = [0, 0.25]; nesterov dir = mean + 0.9 m = [0, 0.475]; theta -= 0.7 * dir
    for m in models:
        assert _weights(m) == pytest.approx([1.0, 2.0 - 0.7 * 0.475], abs=1e-6)
    assert res[0].contributors == ("w0", "w1") and res[0].included
    assert outers[0].round_id == 1
    # round 2: both workers move by [0.1, 0.1] -> delta = [-0.1, -0.1]; m = 0.9*[0, .25] + [-.1, -.1]
    for m in models:
        _set(m, [w + 0.1 for w in _weights(m)])
    _round(outers, hub)
    mom = [0.9 * 0.0 - 0.1, 0.9 * 0.25 - 0.1]
    direction = [-0.1 + 0.9 * mom[0], -0.1 + 0.9 * mom[1]]
    expect = [1.0 - 0.7 * direction[0], 2.0 - 0.7 * 0.475 - 0.7 * direction[1]]
    for m in models:
        assert _weights(m) == pytest.approx(expect, abs=1e-6)


def test_sparseloco_one_round_by_hand_with_error_feedback():
    models = [_model([0.0, 0.0]), _model([0.0, 0.0])]
    codec = KeepLargest()
    outers = [SparseLoCo(m.parameters(), codec, SparseLoCoConfig(lr=1.0, error_decay=0.5)) for m in models]
    hub = InProcessHub(codec, ["w0", "w1"])
    _set(models[0], [-0.5, 0.2])  # delta [0.5, -0.2] -> sends [0.5, 0], keeps e = [0, -0.2]
    _set(models[1], [0.1, -0.3])  # delta [-0.1, 0.3] -> sends [0, 0.3], keeps e = [-0.1, 0]
    _round(outers, hub)
    # mean = [0.25, 0.15]; theta = -1.0 * mean
    for m in models:
        assert _weights(m) == pytest.approx([-0.25, -0.15], abs=1e-7)
    assert outers[0].error.tolist() == pytest.approx([0.0, -0.2])
    assert outers[1].error.tolist() == pytest.approx([-0.1, 0.0])
    # round 2 without local training: e = 0.5*e + 0 -> w0 sends [0, -0.1], w1 sends [-0.05, 0]
    _round(outers, hub)
    for m in models:
        assert _weights(m) == pytest.approx([-0.25 + 0.025, -0.15 + 0.05], abs=1e-7)
    assert outers[0].error.abs().sum().item() == pytest.approx(0.0)


def test_diloco_dropped_contribution_is_rebased_and_resent():
    models = [_model([1.0, 1.0]), _model([1.0, 1.0])]
    codec = make_codec("fp32")
    outers = [DiLoCo(m.parameters(), codec, DiLoCoConfig(lr=1.0, momentum=0.0)) for m in models]
    hub = InProcessHub(codec, ["w0", "w1"])
    _set(models[0], [0.0, 1.0])  # delta [1, 0], applied
    _set(models[1], [1.0, 3.0])  # delta [0, -2], dropped from the aggregate
    res = _round(outers, hub, drop=["w1"])
    assert res[0].contributors == ("w0",) and not res[1].included
    assert _weights(models[0]) == pytest.approx([0.0, 1.0])
    # w1 keeps its progress (+2 on the second weight) on top of the new global parameters
    assert _weights(models[1]) == pytest.approx([0.0, 3.0])
    res = _round(outers, hub)  # no training in between: w1's delta is exactly its old contribution
    assert res[1].included
    assert _weights(models[0]) == pytest.approx([0.0, 2.0])  # mean of [0,0] and [0,-2] = [0,-1]
    assert _weights(models[1]) == _weights(models[0])


def test_sparseloco_dropped_contribution_stays_in_error_feedback():
    models = [_model([0.0, 0.0]), _model([0.0, 0.0])]
    codec = make_codec("fp32")
    outers = [SparseLoCo(m.parameters(), codec, SparseLoCoConfig(lr=1.0, error_decay=1.0)) for m in models]
    hub = InProcessHub(codec, ["w0", "w1"])
    _set(models[0], [-1.0, 0.0])
    _set(models[1], [0.0, -4.0])  # dropped
    _round(outers, hub, drop=["w1"])
    assert outers[1].error.tolist() == [0.0, 4.0]  # whole contribution kept
    assert _weights(models[1]) == _weights(models[0]) == pytest.approx([-1.0, 0.0])
    _round(outers, hub)
    assert outers[1].error.tolist() == [0.0, 0.0]
    assert _weights(models[1]) == pytest.approx([-1.0, -2.0])  # minus the mean of [0,0] and [0,4]


@pytest.mark.parametrize("eager", [False, True])
def test_sparseloco_keeps_what_norm_clipping_took_off_its_contribution(eager):
    # The mean took our contribution scaled by 0.25 on [0, 2) (clipped in that shard), whole on
    # [2, 4): the clipped-off 0.75 stays in the error feedback and goes out again next round.
    from groundswell.optim import RoundResult

    m = _model([0.0, 0.0, 0.0, 0.0])
    o = SparseLoCo(m.parameters(), make_codec("fp32"), SparseLoCoConfig(lr=1.0, error_decay=1.0, eager=eager))
    _set(m, [-4.0, -8.0, -1.0, -2.0])  # delta [4, 8, 1, 2], all sent (fp32)
    o.prepare()
    mean = torch.tensor([1.0, 2.0, 1.0, 2.0])  # what a mean with our clipped part would hold
    o.apply(RoundResult(0, mean, ("w0",), True, 0, 0, scaled=((0, 2, 0.25),)))
    assert o.error.tolist() == [3.0, 6.0, 0.0, 0.0]
    assert o.global_params.tolist() == [-1.0, -2.0, -1.0, -2.0]
    o.prepare()  # no training since: the kept part is the whole next contribution
    o.apply(RoundResult(1, torch.tensor([3.0, 6.0, 0.0, 0.0]), ("w0",), True, 0, 0))
    assert o.error.tolist() == [0.0, 0.0, 0.0, 0.0]
    assert o.global_params.tolist() == [-4.0, -8.0, -1.0, -2.0]  # all of the first delta, in the end


def test_failed_round_applies_nothing_and_is_retried():
    models = [_model([1.0, 1.0]), _model([1.0, 1.0])]
    codec = make_codec("fp32")
    outers = [DiLoCo(m.parameters(), codec) for m in models]
    hub = InProcessHub(codec, ["w0", "w1"], min_contributors=2)
    _set(models[0], [0.0, 1.0])
    _set(models[1], [1.0, 0.0])
    res = _round(outers, hub, drop=["w1"])  # only one contribution: below quorum
    assert res == [None, None]
    assert all(o.round_id == 0 for o in outers)
    assert _weights(models[0]) == [0.0, 1.0] and _weights(models[1]) == [1.0, 0.0]
    assert outers[0].global_params.tolist() == [1.0, 1.0]
    res = _round(outers, hub)
    assert res[0] is not None and outers[0].round_id == 1
    assert _weights(models[0]) == _weights(models[1])


@pytest.mark.parametrize("algo", ["diloco", "sparseloco"])
def test_state_dict_round_trip_resumes_exactly(algo):
    torch.manual_seed(0)
    codec = make_codec("sparseloco", chunk=64, k=4) if algo == "sparseloco" else make_codec("int8")
    make = (lambda ps: SparseLoCo(ps, codec)) if algo == "sparseloco" else (lambda ps: DiLoCo(ps, codec))
    model = torch.nn.Linear(32, 8)
    outer = make(model.parameters())
    hub = InProcessHub(codec, ["w0"])
    ep = hub.endpoint("w0")
    for _ in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        outer.sync(ep)
    state = outer.state_dict()
    clone = torch.nn.Linear(32, 8)
    clone.load_state_dict(model.state_dict())
    restored = make(clone.parameters())
    restored.load_state_dict(state)
    assert restored.round_id == outer.round_id == 3
    step = [torch.randn_like(p) * 0.1 for p in model.parameters()]
    for m in (model, clone):
        with torch.no_grad():
            for p, s in zip(m.parameters(), step):
                p.add_(s)
    outer.sync(ep)
    restored.sync(hub.endpoint("w0"))
    for a, b in zip(model.parameters(), clone.parameters()):
        assert torch.equal(a, b)
    assert torch.equal(outer.global_params, restored.global_params)
    other = DiLoCo(clone.parameters(), codec) if algo == "sparseloco" else SparseLoCo(clone.parameters(), codec)
    with pytest.raises(ValueError, match=r"not a (DiLoCo|SparseLoCo) state"):
        other.load_state_dict(state)


@pytest.mark.parametrize("algo", ["diloco", "sparseloco"])
def test_a_state_whose_buffer_does_not_fit_the_model_is_refused_whole(algo):
    """An error-feedback buffer too long was cut silently, one too short (or a DiLoCo momentum
    of another shape) failed only at the next round; and the global copy was replaced first."""
    codec = make_codec("sparseloco", chunk=64, k=4) if algo == "sparseloco" else make_codec("fp32")
    make = (lambda ps: SparseLoCo(ps, codec)) if algo == "sparseloco" else (lambda ps: DiLoCo(ps, codec))
    name = "error" if algo == "sparseloco" else "momentum_buffer"
    outer = make(torch.nn.Linear(32, 8).parameters())
    state = outer.state_dict()
    state["global_params"] = state["global_params"] + 1.0
    before = outer.global_params.clone()
    for bad in (torch.zeros(state[name].numel() + 5), torch.zeros(state[name].numel() - 1), "junk"):
        with pytest.raises(ValueError, match=name):
            outer.load_state_dict({**state, name: bad})
        assert torch.equal(outer.global_params, before)  # left as it was
    outer.load_state_dict(state)
    assert torch.equal(outer.global_params, state["global_params"])


def test_applied_parameters_do_not_alias_the_global_copy():
    model = _model([1.0, 2.0])
    codec = make_codec("fp32")
    outer = DiLoCo(model.parameters(), codec)
    hub = InProcessHub(codec, ["w0"])
    _set(model, [0.5, 2.5])
    outer.sync(hub.endpoint("w0"))
    before = outer.global_params.clone()
    with torch.no_grad():
        model.weight.add_(10.0)  # training after the round must not move theta_global
    assert torch.equal(outer.global_params, before)


def test_copy_into_parameters_copies_instead_of_aliasing():
    from groundswell.optim import copy_into_parameters

    model = torch.nn.Linear(3, 2)
    vec = torch.arange(8, dtype=torch.float32)
    copy_into_parameters(vec, list(model.parameters()))
    with torch.no_grad():
        model.weight.add_(1.0)
    assert torch.equal(vec, torch.arange(8, dtype=torch.float32))
    with pytest.raises(ValueError):
        copy_into_parameters(torch.zeros(9), list(model.parameters()))


@pytest.mark.parametrize("algo", ["diloco", "sparseloco"])
def test_a_non_contiguous_parameter_is_flattened_in_its_logical_order(algo):
    # (a review: torch's parameters_to_vector `view`s each parameter, and a channels_last or
    # transposed weight made the optimizer's first line raise)
    model = torch.nn.Linear(4, 3)
    model.weight = torch.nn.Parameter(torch.arange(12.0).view(3, 4).t().contiguous().t())
    assert not model.weight.is_contiguous()
    outer = (DiLoCo(list(model.parameters()), make_codec("fp32"), DiLoCoConfig()) if algo == "diloco" else
             SparseLoCo(list(model.parameters()), make_codec("sparseloco", chunk=4, k=4), SparseLoCoConfig()))
    assert torch.equal(outer.global_params[:12], torch.arange(12.0))
    with torch.no_grad():
        model.weight.add_(1.0)
    assert torch.equal(outer.local_vector()[:12], torch.arange(12.0) + 1)
    assert len(outer.prepare()) >= 1


def test_delayed_outer_step_carries_the_progress_made_while_the_round_was_exchanged():
    # overlap = 1 (Streaming DiLoCo's delayed outer step): after prepare, each worker trains on;
    # apply() moves the global parameters and keeps exactly the progress made since prepare.
    models = [_model([1.0, 2.0]), _model([1.0, 2.0])]
    codec = make_codec("fp32")
    outers = [DiLoCo(m.parameters(), codec, DiLoCoConfig(lr=0.7, momentum=0.9)) for m in models]
    hub = InProcessHub(codec, ["w0", "w1"])
    eps = [hub.endpoint("w0"), hub.endpoint("w1")]
    _set(models[0], [0.5, 2.5])
    _set(models[1], [1.5, 1.0])
    for ep, o in zip(eps, outers):
        ep.contribute(o.round_id, o.prepare())
    _set(models[0], [0.7, 2.4])  # trained on while round 0 was in flight: progress [0.2, -0.1]
    _set(models[1], [1.5, 1.3])  # progress [0, 0.3]
    for ep, o in zip(eps, outers):
        o.apply(ep.collect(o.round_id))
    g = [1.0, 2.0 - 0.7 * 0.475]  # the same outer step as the blocking round above
    assert outers[0].global_params.tolist() == pytest.approx(g, abs=1e-6)
    assert torch.equal(outers[0].global_params, outers[1].global_params)
    assert _weights(models[0]) == pytest.approx([g[0] + 0.2, g[1] - 0.1], abs=1e-6)
    assert _weights(models[1]) == pytest.approx([g[0], g[1] + 0.3], abs=1e-6)
    # round 1's contribution is the progress since the agreed parameters: exactly the carried part
    payloads = outers[0].prepare()
    assert outers[0].decode(payloads).tolist() == pytest.approx([-0.2, 0.1], abs=1e-6)


def test_sparseloco_eager_start_trains_on_from_its_own_step_and_keeps_the_globals_agreed():
    # SparseLoCo with overlap: at prepare the local parameters move to theta_global + step(own
    # payload), what this worker alone would make of the round; the progress trained after that
    # rides on the real aggregate when it arrives, and the global parameters stay identical.
    models = [_model([1.0, 2.0]), _model([1.0, 2.0])]
    outers = [SparseLoCo(m.parameters(), KeepLargest(), SparseLoCoConfig(lr=1.0, error_decay=1.0, eager=True))
              for m in models]
    hub = InProcessHub(make_codec("fp32"), ["w0", "w1"])
    eps = [hub.endpoint("w0"), hub.endpoint("w1")]
    _set(models[0], [0.5, 2.1])  # delta [0.5, -0.1]: sends [0.5, 0]
    _set(models[1], [1.2, 1.0])  # delta [-0.2, 1.0]: sends [0, 1.0]
    for ep, o in zip(eps, outers):
        ep.contribute(o.round_id, o.prepare())
    assert _weights(models[0]) == pytest.approx([0.5, 2.0])  # theta_global - 1.0 * [0.5, 0]
    assert _weights(models[1]) == pytest.approx([1.0, 1.0])  # theta_global - 1.0 * [0, 1.0]
    _set(models[0], [0.6, 2.0])  # trained on from there: progress [0.1, 0]
    _set(models[1], [1.0, 0.7])  # progress [0, -0.3]
    for ep, o in zip(eps, outers):
        o.apply(ep.collect(o.round_id))
    g = [1.0 - 0.25, 2.0 - 0.5]  # mean of [0.5, 0] and [0, 1.0], outer SGD lr 1
    assert torch.equal(outers[0].global_params, outers[1].global_params)
    assert outers[0].global_params.tolist() == pytest.approx(g)
    assert _weights(models[0]) == pytest.approx([g[0] + 0.1, g[1]])
    assert _weights(models[1]) == pytest.approx([g[0], g[1] - 0.3])
    # what the round did not carry stays in the error feedback: [0, -0.1] and [-0.2, 0]
    assert outers[0].error.tolist() == pytest.approx([0.0, -0.1])
    assert outers[1].error.tolist() == pytest.approx([-0.2, 0.0])


def test_sparseloco_eager_start_changes_nothing_when_rounds_do_not_overlap():
    # Blocking rounds apply right after prepare: the eager start is overwritten before any step.
    def run(eager: bool) -> list[list[float]]:
        models = [_model([1.0, 2.0]), _model([1.0, 2.0])]
        outers = [SparseLoCo(m.parameters(), KeepLargest(), SparseLoCoConfig(lr=0.8, eager=eager)) for m in models]
        hub = InProcessHub(make_codec("fp32"), ["w0", "w1"])
        for step in range(3):
            _set(models[0], [0.5 + step, 2.1])
            _set(models[1], [1.2, 1.0 - step])
            _round(outers, hub)
        return [_weights(m) for m in models] + [o.global_params.tolist() for o in outers]

    assert run(True) == run(False)


class Counting(KeepLargest):
    """KeepLargest that counts its decodes (class-wide)."""

    decodes = 0

    def decode(self, payload, device=None):
        Counting.decodes += 1
        return super().decode(payload, device=device)


def test_sparseloco_eager_start_decodes_its_own_payload_once_per_round():
    # the eager start and the settling of the round need the same decoded payload: one decode
    Counting.decodes = 0
    m = _model([1.0, 2.0])
    o = SparseLoCo(m.parameters(), Counting(), SparseLoCoConfig(lr=1.0, error_decay=1.0, eager=True))
    hub = InProcessHub(make_codec("fp32"), ["w0"])
    ep = hub.endpoint("w0")
    _set(m, [0.5, 2.1])
    payloads = o.prepare()
    assert len(payloads) == 1 and Counting.decodes == 1  # for the eager start
    ep.contribute(o.round_id, payloads)
    o.apply(ep.collect(o.round_id))
    assert Counting.decodes == 1  # settling reused it
    assert o.error.tolist() == pytest.approx([0.0, -0.1])  # what a second decode would have given


def test_sparseloco_decodes_again_when_the_pending_payloads_are_not_the_cached_ones():
    # a retried round (apply(None)) drops the cached vector; the next round decodes its own payload
    m = _model([1.0, 2.0])
    o = SparseLoCo(m.parameters(), Counting(), SparseLoCoConfig(lr=1.0, error_decay=1.0, eager=True))
    hub = InProcessHub(make_codec("fp32"), ["w0"])
    ep = hub.endpoint("w0")
    _set(m, [0.5, 2.1])
    o.prepare()
    o.apply(None)  # the round failed: the contribution stays in the error feedback
    assert o._sent is None
    payloads = o.prepare()
    o._sent = (list(payloads), o._sent[1])  # same contents, another object: not trusted as ours
    before = Counting.decodes
    ep.contribute(o.round_id, payloads)
    o.apply(ep.collect(o.round_id))
    assert Counting.decodes == before + 1


def _outcome(round_id: int, mean: torch.Tensor, included: bool):
    from groundswell.optim import RoundResult

    return RoundResult(round_id, mean, ("w0",), included, 0, 0)


@pytest.mark.parametrize("algo", ["diloco", "sparseloco"])
def test_a_contribution_learned_late_to_be_in_an_aggregate_is_not_sent_again(algo):
    """The leader committed our contribution and died before telling us: the round was settled as
    failed (work kept), then the commit was learned by catching up. `settle_late` must leave the
    worker exactly where settling the round on time would have."""
    def make():
        model = _model([1.0, 2.0])
        if algo == "diloco":  # an exact codec: settled late, DiLoCo keeps a lossy codec's residual as local work
            return model, DiLoCo(model.parameters(), make_codec("fp32"), DiLoCoConfig(lr=0.7, momentum=0.9))
        return model, SparseLoCo(model.parameters(), KeepLargest(), SparseLoCoConfig(lr=1.0, error_decay=0.5,
                                                                                     eager=False))

    def state(model, outer):  # one flat list: pytest.approx compares no nested ones
        return [*_weights(model), *outer.global_params.tolist(), outer.round_id,
                *(outer.error.tolist() if algo == "sparseloco" else outer.momentum_buffer.tolist())]

    on_time, late = make(), make()
    for model, _ in (on_time, late):
        _set(model, [0.5, 1.25])  # the same H inner steps on both
    sent = on_time[1].prepare()
    mean = on_time[1].decode(sent)  # we were the round's only contributor
    on_time[1].apply(_outcome(0, mean, included=True))

    late_sent = late[1].prepare()
    late[1].apply(None)  # no leader answered: the work stays ours
    late[1].follow(0, mean)  # catching up applies the commit, which holds our contribution
    assert state(*late) != state(*on_time)  # without settling it, it would go out again
    late[1].settle_late(late_sent, prepared_since=0)
    assert state(*late) == pytest.approx(state(*on_time))

    # learned one contribution later (the next attempt found the round closed): same place again
    def train(model):  # the next H inner steps: the same progress from wherever the model starts
        _set(model, [w + d for w, d in zip(_weights(model), [-0.75, -0.25])])

    train(on_time[0])
    on_time[1].prepare()
    on_time[1].apply(None)
    if algo == "sparseloco":
        late2 = make()
        _set(late2[0], [0.5, 1.25])
        first = late2[1].prepare()
        late2[1].apply(None)
        train(late2[0])
        late2[1].prepare()  # round 0 again: its second attempt
        late2[1].apply(_outcome(0, mean, included=False))  # attempt 0's commit; this contribution is not in it
        assert late2[1].error.tolist() != pytest.approx(on_time[1].error.tolist())
        late2[1].settle_late(first, prepared_since=1)
        # on time: e1 = e0 - s0 then e = beta e1 + delta2; late: beta e0 + delta2 - beta s0: the same
        assert late2[1].error.tolist() == pytest.approx(on_time[1].error.tolist())
        assert late2[1].global_params.tolist() == pytest.approx(on_time[1].global_params.tolist())
        assert _weights(late2[0]) == pytest.approx(_weights(on_time[0]))


def test_settle_late_refuses_while_a_round_is_pending():
    model = _model([1.0, 2.0])
    outer = DiLoCo(model.parameters(), KeepLargest())
    sent = outer.prepare()
    with pytest.raises(RuntimeError, match="pending"):
        outer.settle_late(sent, 0)


class Refusing(KeepLargest):
    """KeepLargest whose encode or decode raises CodecError while `refuse` names it."""

    def __init__(self) -> None:
        super().__init__()
        self.refuse = ""

    def encode(self, x: torch.Tensor) -> Payload:
        if self.refuse == "encode":
            raise CodecError("cannot encode: values too large")
        return super().encode(x)

    def decode(self, payload, device=None):
        if self.refuse == "decode":
            raise CodecError("refused")
        return super().decode(payload, device=device)


@pytest.mark.parametrize("eager, fails", [(False, "encode"), (True, "encode"), (True, "decode")])
def test_sparseloco_prepare_that_raises_leaves_the_optimizer_as_it_was(eager, fails):
    # A caller that catches the CodecError and trains on must not find the pseudo-gradient both in
    # the error feedback and in its parameters: a raising prepare() changes nothing.
    def setup():
        m = _model([1.0, 2.0, 3.0])
        codec = Refusing()
        o = SparseLoCo(m.parameters(), codec, SparseLoCoConfig(lr=1.0, error_decay=0.5, eager=eager))
        _set(m, [0.5, 2.1, 3.0])
        o.prepare()
        o.apply(None)  # a non-zero error feedback to keep: [0.5, 0, 0] stays in it
        _set(m, [0.25, 2.5, 2.0])
        return m, o, codec

    m, o, codec = setup()
    error, params, sent = o.error.clone(), _weights(m), o._sent
    codec.refuse = fails
    with pytest.raises(CodecError):
        o.prepare()
    assert torch.equal(o.error, error)
    assert _weights(m) == params
    assert o.pending is None and o._sent is sent
    codec.refuse = ""
    payloads = o.prepare()  # and the next try is exactly the one that never failed
    m2, o2, _ = setup()
    assert torch.equal(o.decode(payloads), o2.decode(o2.prepare()))
    assert torch.equal(o.error, o2.error) and _weights(m) == _weights(m2)


def test_sync_whose_contribution_comes_too_late_fails_the_round_and_keeps_the_work():
    # The hub refuses a contribution to a round already aggregated (RoundFailed from contribute):
    # sync() settles it as a failed round instead of leaving it pending forever.
    codec = make_codec("fp32")
    hub = InProcessHub(codec, ["w0", "w1"])
    other = DiLoCo(_model([1.0, 2.0]).parameters(), codec)
    hub.endpoint("w0").contribute(0, other.prepare())  # round 0 fills up without this worker's
    hub.endpoint("w1").contribute(0, other.encode(torch.zeros(2)))
    hub.endpoint("w1").collect(0)  # aggregated: a contribution to round 0 is now too late
    model = _model([1.0, 2.0])
    outer = DiLoCo(model.parameters(), codec)
    _set(model, [0.5, 2.5])
    assert outer.sync(hub.endpoint("w0")) is None
    assert outer.pending is None and outer.round_id == 0
    assert _weights(model) == [0.5, 2.5] and outer.global_params.tolist() == [1.0, 2.0]
    outer.prepare()  # not "still pending"


def test_a_round_that_timed_out_on_the_in_process_hub_is_void_for_every_worker():
    """Found by a review: the hub kept a timed-out round's payloads, so the worker's retry was
    refused as a second contribution, and a late worker aggregated the stale one (counted twice
    once its owner retried it)."""
    codec = make_codec("fp32")
    hub = InProcessHub(codec, ["a", "b"], timeout_s=0.05)
    a, b = hub.endpoint("a"), hub.endpoint("b")
    payloads = [codec.encode(torch.ones(4))]
    a.contribute(0, payloads)
    with pytest.raises(RoundFailed):
        a.collect(0)  # b never came in time
    a.contribute(0, payloads)  # the retry: not a second contribution
    b.contribute(0, [codec.encode(torch.zeros(4))])
    assert a.collect(0).contributors == b.collect(0).contributors == ("a", "b")


def test_workers_that_time_out_at_different_moments_still_complete_the_round_on_a_retry():
    """Review of the fix above: each waiter voided the round when its own wait ran out, taking the
    others' retries with it; with staggered workers round 0 never completed."""
    import threading
    import time

    codec = make_codec("fp32")
    hub = InProcessHub(codec, ["a", "b", "c"], timeout_s=0.3)
    results: dict[str, object] = {}

    def worker(name: str, delay: float) -> None:
        time.sleep(delay)
        ep = hub.endpoint(name)
        for _ in range(8):
            ep.contribute(0, [codec.encode(torch.ones(4))])
            try:
                results[name] = ep.collect(0).contributors
                return
            except RoundFailed:
                continue

    threads = [threading.Thread(target=worker, args=(n, d)) for n, d in (("a", 0.0), ("b", 0.1), ("c", 0.35))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert results == {w: ("a", "b", "c") for w in "abc"}


@pytest.mark.parametrize("algo", ["diloco", "sparseloco"])
def test_an_outer_step_past_fp32s_range_leaves_those_parameters_as_they_were(algo):
    # Found by a review of the wire boundary: a finite mean near fp32's limit (one hostile
    # contribution, clipping off) took Nesterov's step, and then the parameters, to -inf on every
    # peer alike, for good. Those coordinates now keep their values, and their momentum restarts.

    m = _model([1.0, 2.0, 3.0])
    o = (DiLoCo(m.parameters(), make_codec("fp32"), DiLoCoConfig(lr=0.7, momentum=0.9)) if algo == "diloco"
         else SparseLoCo(m.parameters(), make_codec("fp32"), SparseLoCoConfig(lr=1.0, eager=False)))
    huge = 3.3e38
    for round_id in range(3):
        o.follow(round_id, torch.tensor([huge, -huge, 0.5]))
        assert bool(torch.isfinite(o.global_params).all()), f"round {round_id}: parameters left fp32's range"
        assert _weights(m) == o.global_params.tolist()
    assert o.global_params[2].item() != 3.0, "the coordinate that did not overflow must still move"
    if algo == "diloco":
        assert bool(torch.isfinite(o.momentum_buffer).all())


class _PartlyFrozen(torch.nn.Module):
    """A small trainable tensor in the same 4096-value codec chunk as a frozen one."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(16))
        self.b = torch.nn.Parameter(torch.ones(4080), requires_grad=False)


@pytest.mark.parametrize("algorithm, codec_name", [("sparseloco", "sparseloco"), ("diloco", "int8"),
                                                   ("diloco", "fp32")])
def test_no_outer_step_moves_a_frozen_parameter(algorithm, codec_name):
    # SparseLoCo's 2-bit values have no zero: a chunk with fewer nonzeros than its top-k sent
    # the frozen tensor's zero pseudo-gradient as +L0*scale, and every round moved 48 of its
    # 4080 values (and put the opposite into the error feedback, to be sent again).
    codec = make_codec(codec_name)
    models = [_PartlyFrozen() for _ in range(3)]
    make = (lambda m: SparseLoCo(m.parameters(), codec, SparseLoCoConfig())) if algorithm == "sparseloco" else \
        (lambda m: DiLoCo(m.parameters(), codec, DiLoCoConfig()))
    outers = [make(m) for m in models]
    follower_model = _PartlyFrozen()
    follower = make(follower_model)
    hub = InProcessHub(codec, ["w0", "w1", "w2"])
    gen = torch.Generator().manual_seed(5)
    for _ in range(4):
        for m in models:
            with torch.no_grad():  # inner steps touch only the trainable tensor
                m.a.add_(torch.randn(16, generator=gen) * 0.01)
        eps = [hub.endpoint(f"w{i}") for i in range(3)]
        for ep, o in zip(eps, outers):
            ep.contribute(o.round_id, o.prepare())
        results = [o_ep[1].collect(o_ep[0].round_id) for o_ep in zip(outers, eps)]
        for o, result in zip(outers, results):
            o.apply(result)
        follower.follow(results[0].round_id, results[0].mean)
    for m in [*models, follower_model]:
        assert torch.equal(m.b.detach(), torch.ones(4080))
        assert torch.equal(m.a.detach(), models[0].a.detach()) and m.a.abs().sum() > 0  # it trained, all agree
    if algorithm == "sparseloco":
        assert all(not o.error[16:].any() for o in outers)  # nothing of the frozen tensor waits to be sent
    # A state saved before frozen parameters were masked may hold error feedback or momentum there.
    state = outers[0].state_dict()
    name = "error" if algorithm == "sparseloco" else "momentum_buffer"
    state[name][16:] = 1.0
    outers[0].load_state_dict(state)
    assert not getattr(outers[0], name)[16:].any() and torch.equal(getattr(outers[0], name)[:16], state[name][:16])


@pytest.mark.parametrize("algo", ["diloco", "sparseloco"])
def test_a_mean_that_does_not_fit_the_model_is_refused_before_anything_changes(algo):
    """Found by a review: a one-value mean broadcast over every parameter (every one moved by
    it), and one of shape (n, 1) failed only after the momentum had decayed."""
    codec = make_codec("sparseloco", chunk=64, k=4) if algo == "sparseloco" else make_codec("fp32")
    make = (lambda ps: SparseLoCo(ps, codec)) if algo == "sparseloco" else (lambda ps: DiLoCo(ps, codec))
    model = torch.nn.Linear(32, 8)
    outer = make(model.parameters())
    hub = InProcessHub(codec, ["w0"])
    with torch.no_grad():
        model.weight.add_(0.1)
    outer.sync(hub.endpoint("w0"))  # some momentum / error feedback to keep
    n = outer.global_params.numel()
    name = "error" if algo == "sparseloco" else "momentum_buffer"

    def snapshot():
        return [outer.global_params.clone(), getattr(outer, name).clone(), outer.round_id,
                *(p.detach().clone() for p in model.parameters())]

    def same(a, b):
        return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))

    for bad in (torch.ones(1), torch.ones(n + 1), torch.ones(n, 2), torch.ones(n, dtype=torch.int64)):
        before = snapshot()
        with pytest.raises(ValueError, match="mean"):
            outer.follow(outer.round_id, bad)
        assert same(snapshot(), before)
        outer.prepare()
        before = snapshot()
        with pytest.raises(ValueError, match="mean"):
            outer.apply(_outcome(outer.round_id, bad, True))
        assert same(snapshot(), before)
        assert outer.pending is not None  # still pending: the caller may apply(None) and keep its work
        outer.apply(None)
    mean = torch.full((n, 1), 0.5)  # one value per parameter, whatever its shape: taken
    outer.follow(outer.round_id, mean)
    assert outer.round_id == 2


def test_parameters_that_are_not_float32_are_refused():
    """Found by a review: with bf16 parameters, rounding theta_global into them was sent as a
    pseudo-gradient every round, and idle peers drifted the model."""
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        with pytest.raises(ValueError, match="float32 parameters"):
            DiLoCo(torch.nn.Linear(4, 2).to(dtype).parameters(), make_codec("fp32"))


@pytest.mark.parametrize("bad", ["int64", "nan", "no-round", "negative-round"])
def test_a_state_that_is_no_state_of_ours_is_refused_whole(bad):
    codec = make_codec("sparseloco", chunk=64, k=4)
    outer = SparseLoCo(torch.nn.Linear(32, 8).parameters(), codec)
    state = outer.state_dict()
    if bad == "int64":
        state["global_params"] = state["global_params"].long()
    elif bad == "nan":
        state["error"] = state["error"].clone()
        state["error"][3] = float("nan")
    elif bad == "no-round":
        del state["round_id"]
    else:
        state["round_id"] = -1
    before = outer.global_params.clone()
    with pytest.raises(ValueError):
        outer.load_state_dict(state)
    assert torch.equal(outer.global_params, before) and outer.round_id == 0


def test_contributions_that_do_not_aggregate_fail_the_round_for_every_worker():
    """A CodecError while aggregating left the workers with a round pending for good."""
    codec = make_codec("fp32")
    small, big = _model([1.0, 2.0]), _model([1.0, 2.0, 3.0])
    outers = [DiLoCo(small.parameters(), codec), DiLoCo(big.parameters(), codec)]
    results = _round(outers, InProcessHub(codec, ["w0", "w1"]))
    assert results == [None, None]
    assert all(o.pending is None and o.round_id == 0 for o in outers)
