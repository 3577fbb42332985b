"""Elastic data: when the number of ranks changes, what is left of the epoch in progress is dealt again
among the new ranks (data.redeal): no sample twice in an epoch, none lost (DDP's equal shares leave out
fewer than the new world size), whatever the ranks' positions were."""

import random
from collections import Counter

import pytest
import torch

from kubetrain.trainer.data import EpochPlan, ShardCursor, redeal
from kubetrain.trainer.errors import ConfigError


def order(seed, epoch, n):
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


class Run:
    """Ranks taking batches, resized now and then; every sample taken is recorded by epoch."""

    def __init__(self, n, world, batch, seed=5):
        self.n, self.batch, self.seed = n, batch, seed
        self.cursors = [ShardCursor(n, r, world, batch, seed) for r in range(world)]
        self.seen: dict[int, Counter] = {}

    def resize(self, world, equal):
        states = redeal([c.state_dict() for c in self.cursors], world, equal)
        self.cursors = []
        for s in states:
            c = ShardCursor(self.n, s["rank"], world, self.batch, self.seed)
            c.load_state_dict(s)
            self.cursors.append(c)


def take(run, rank):
    """One batch of `rank`, recorded under the epoch it came from."""
    c = run.cursors[rank]
    while c.shard_size == 0:
        c._next_epoch()
    epoch = c.epoch
    run.seen.setdefault(epoch, Counter()).update(c.next_batch().tolist())


def test_the_default_plan_is_the_strided_shard_of_old():
    for n, w in ((10, 3), (64, 4), (7, 7)):
        for r in range(w):
            assert EpochPlan((), 0, n, True).share(r, w) == list(range(r, n // w * w, w))


@pytest.mark.parametrize("n, sizes, equal", [
    (100, [2, 3, 1], False),   # a ParameterServer job's workers: 2 -> 3 -> 1
    (100, [2, 1, 2], True),    # a DDP group: 2 -> 1 -> 2 nodes
    (97, [4, 3, 5, 2], False),
    (97, [4, 3, 5, 2], True),
])
def test_ranks_in_step_resized_mid_epoch_see_every_sample_of_the_epoch_once(n, sizes, equal):
    run = Run(n, sizes[0], batch=4)
    for size in sizes[1:]:
        for _ in range(3):  # every rank takes three batches, together (Sync, DDP)
            for r in range(len(run.cursors)):
                take(run, r)
        run.resize(size, equal)
    while run.cursors[0].epoch == 0 or any(c.epoch == 0 for c in run.cursors):
        for r in range(len(run.cursors)):
            if run.cursors[r].epoch == 0:
                take(run, r)
    seen = run.seen[0]
    assert max(seen.values()) == 1, "a sample was taken twice in the epoch"
    # Left out: the first world's own rounding (n % sizes[0]) and, with equal shares, fewer than the
    # new world size at each re-deal.
    default_left_out = n % sizes[0]
    lost = n - len(seen)
    if equal:
        assert default_left_out <= lost < default_left_out + sum(sizes[1:])
    else:
        assert lost == default_left_out


@pytest.mark.parametrize("seed", range(12))
def test_ranks_out_of_step_are_dealt_the_holes_too(seed):
    """Async workers are up to maxStaleness steps apart, and some may have begun the next epoch."""
    rng = random.Random(seed)
    n, batch = rng.randint(20, 120), rng.randint(1, 6)
    world = rng.randint(1, 4)
    run = Run(n, world, batch, seed=seed)
    for _ in range(rng.randint(1, 3)):
        for _ in range(rng.randint(0, 30)):
            take(run, rng.randrange(len(run.cursors)))
        run.resize(rng.randint(1, 5), equal=False)
    epochs_begun = max(run.seen) if run.seen else 0
    # Finish every epoch begun so far.
    while min(c.epoch for c in run.cursors) <= epochs_begun:
        r = min(range(len(run.cursors)), key=lambda i: (run.cursors[i].epoch, i))
        take(run, r)
    for epoch in range(epochs_begun + 1):
        seen = run.seen[epoch]
        assert max(seen.values()) == 1, f"epoch {epoch}: a sample taken twice"
        assert set(seen) <= set(range(n))
        # Nothing is lost beyond the rounding of the epoch's first deal (fewer than its world size, at most 5).
        assert n - len(seen) < (world if epoch == 0 else 5)


def test_a_state_keeps_only_two_numbers_until_a_resize():
    c = ShardCursor(40, 1, 2, 8, seed=0)
    c.next_batch()
    assert "plans" not in c.state_dict()
    state = redeal([ShardCursor(40, r, 2, 8, 0).state_dict() for r in range(2)], 3, equal=False)[2]
    assert state["world_size"] == 3 and state["rank"] == 2 and state["plans"]["0"]["start"] == 0


def test_in_step_ranks_leave_no_holes_so_the_state_stays_small():
    cursors = [ShardCursor(10_000, r, 4, 50, 1) for r in range(4)]
    for c in cursors:
        for _ in range(7):
            c.next_batch()
    plan = redeal([c.state_dict() for c in cursors], 3, equal=True)[0]["plans"]["0"]
    assert plan["holes"] == [] and plan["start"] == 4 * 7 * 50


def test_redeal_refuses_an_incomplete_or_mixed_set_of_cursors():
    two = [ShardCursor(40, r, 2, 8, 0).state_dict() for r in range(2)]
    with pytest.raises(ConfigError, match="one per rank of 2, got ranks \\[0\\]"):
        redeal(two[:1], 3, equal=False)
    other = ShardCursor(40, 1, 2, 8, 9).state_dict()
    with pytest.raises(ConfigError, match="disagree on seed"):
        redeal([two[0], other], 3, equal=False)
    with pytest.raises(ConfigError, match="40 training samples cannot be sharded over 41 ranks"):
        redeal(two, 41, equal=False)


def test_steps_left_counts_the_redealt_epoch_then_whole_ones():
    fresh = ShardCursor(100, 0, 2, 10, 0)
    assert fresh.steps_left(3) == 3 * fresh.steps_per_epoch == 15
    halves = [ShardCursor(100, r, 2, 10, 0) for r in range(2)]
    for c in halves:
        for _ in range(2):
            c.next_batch()
    state = redeal([c.state_dict() for c in halves], 1, equal=False)[0]
    one = ShardCursor(100, 0, 1, 10, 0)
    one.load_state_dict(state)
    assert one.shard_size == 60  # 100 - 2 x 2 x 10 taken
    assert one.steps_left(2) == 6 + 10


def test_a_rank_dealt_nothing_of_an_epoch_reports_whole_epochs_and_moves_on():
    """Rank 0 finished epoch 0, rank 1 has 3 of its 20 samples left: dealt among 5, two new ranks get
    none of epoch 0, and every one gets 8 of epoch 1 (40 samples, nobody had begun it)."""
    old = [ShardCursor(40, r, 2, 4, 0) for r in range(2)]
    states = [{**old[0].state_dict(), "epoch": 1, "position": 0}, {**old[1].state_dict(), "position": 17}]
    new = []
    for s in redeal(states, 5, equal=False):
        c = ShardCursor(40, s["rank"], 5, 4, 0)
        c.load_state_dict(s)
        new.append(c)
    assert [c.shard_size for c in new] == [1, 1, 1, 0, 0]
    assert [len(c.positions(1)) for c in new] == [8] * 5
    assert new[4].epochs_done == 0.0  # nothing dealt: no division by its empty shard
    first = new[4].next_batch()  # skips to the next epoch
    assert new[4].epoch == 1 and len(first) == 4
