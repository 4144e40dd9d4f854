"""What a volunteer trains on: its own seeded order of the whole training stream."""

from __future__ import annotations

import torch
from test_state_trust import make_participant


def test_each_volunteer_draws_from_the_whole_corpus_in_an_order_of_its_own(tmp_path, corpus):
    # Volunteers used to take 1 of 1024 fixed shards: 1/1024 of the corpus, seen again every few
    # inner steps, and two peers whose ids fell on the same shard got the same batches.
    from groundswell.peer.roles import volunteer_trainer

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = volunteer_trainer(make_participant(tmp_path / "a", corpus))
    b = volunteer_trainer(make_participant(tmp_path / "b", corpus))
    assert len(a.sampler.windows) == len(b.sampler.windows) > 1000
    assert sorted(a.sampler.windows.tolist()) == sorted(b.sampler.windows.tolist())  # the same, whole stream ...
    xa, _ = a.sampler.next_batch()
    xb, _ = b.sampler.next_batch()
    assert not torch.equal(xa, xb)  # ... in different orders
