"""The fault-tolerant job's one cursor (kubetrain/trainer/data.py's QuorumCursor): the blocks each step's quorum shares
are plain DDP's global batches while no rank is missing, and whatever the ranks and the discarded steps, every
sample of an epoch's cut is trained exactly once."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from kubetrain.trainer.data import QuorumCursor, ShardCursor
from kubetrain.trainer.errors import ConfigError
from kubetrain.trainer.shards import ShardOrder


@pytest.mark.parametrize("num_samples,lanes,batch,sharded", [
    (1437, 2, 32, False),  # digits' training split at 2 ranks: a short last batch
    (1437, 3, 32, False),
    (103, 4, 8, False),
    (64, 2, 100, False),  # one batch per epoch, shorter than asked
    (1000, 3, 16, True),  # sharded data's own order, dealt by shard to the lanes
])
def test_with_every_rank_every_step_the_shares_are_plain_ddps_batches(num_samples, lanes, batch, sharded):
    order = ShardOrder([100] * (num_samples // 100), seed=5) if sharded else None
    ddp = [ShardCursor(num_samples, r, lanes, batch, 5, order=order) for r in range(lanes)]
    cursor = QuorumCursor(num_samples, batch, 5, nominal=lanes, order=order)
    end = cursor.end(None, 2)
    steps = 0
    while not cursor.done(end):
        assert cursor.nominal_step == steps
        block = cursor.next_block(lanes, end)
        for lane in range(lanes):
            assert torch.equal(cursor.share(block, lane), ddp[lane].next_batch()), (steps, lane)
        cursor.advance(block)
        steps += 1
    assert steps == 2 * ddp[0].steps_per_epoch == 2 * cursor.steps_per_epoch
    assert all(c.epoch == 2 and c.position == 0 for c in ddp)


def trained_epochs(cursor: QuorumCursor, end: tuple[int, int], rng: random.Random, max_lanes: int,
                   discard: float) -> tuple[dict[int, Counter], dict[int, torch.Tensor], int]:
    """Run `cursor` to `end` with a random number of ranks each step and random discards; what each epoch trained."""
    trained: dict[int, Counter] = {}
    orders: dict[int, torch.Tensor] = {}
    steps = 0
    while not cursor.done(end):
        lanes = rng.randint(1, max_lanes)
        block = cursor.next_block(lanes, end)
        shares = [cursor.share(block, lane) for lane in range(lanes)]
        assert sum(len(s) for s in shares) == block.size
        assert [len(s) for s in shares] == [block.count(lane) for lane in range(lanes)]
        assert max(len(s) for s in shares) <= cursor.batch_size
        if rng.random() < discard:
            continue  # a discarded step: its samples are dealt again by the next quorum
        orders[block.epoch] = cursor.epoch_order()[:cursor.cut].clone()
        trained.setdefault(block.epoch, Counter()).update(torch.cat(shares).tolist())
        cursor.advance(block)
        steps += 1
    return trained, orders, steps


@pytest.mark.parametrize("seed", range(6))
def test_whatever_the_quorums_and_discards_every_sample_of_an_epoch_is_trained_once(seed):
    rng = random.Random(seed)
    cursor = QuorumCursor(997, 8, seed, nominal=3)
    trained, orders, _ = trained_epochs(cursor, cursor.end(None, 3), rng, max_lanes=5, discard=0.2)
    assert sorted(trained) == [0, 1, 2]
    assert cursor.trained == sum(sum(c.values()) for c in trained.values())  # the committed samples, counted
    for epoch, counts in trained.items():
        assert set(counts.values()) == {1}, f"epoch {epoch}: a sample trained twice"
        assert sorted(counts) == sorted(orders[epoch].tolist())  # the whole cut, nothing else
        assert len(counts) >= 997 - 4  # fewer than the lanes left out, as plain DDP leaves out


def test_a_cursor_moved_between_groups_mid_epoch_goes_on_where_the_committed_one_was():
    """A heal or a checkpoint carries the state: the receiver deals the very next block."""
    rng = random.Random(1)
    first = QuorumCursor(500, 16, 0, nominal=2)
    end = first.end(None, 2)
    for _ in range(7):
        first.advance(first.next_block(rng.randint(1, 3), end))
    second = QuorumCursor(500, 16, 0, nominal=5)  # a group started by a resize: its own nominal is replaced
    second.load_state_dict(first.state_dict())
    assert second.nominal == 2 and second.state_dict() == first.state_dict()
    block = first.next_block(3, end)
    assert torch.equal(first.share(block, 2), second.share(second.next_block(3, end), 2))


def test_max_steps_ends_after_plain_ddps_samples_at_the_nominal_ranks_however_many_train():
    plain = QuorumCursor(1437, 32, 0, nominal=2)
    end = plain.end(50, None)
    assert plain.steps_per_epoch == 23  # 1437 // 2 = 718 samples a rank, 32 a batch
    assert end == (2, 4 * 64)  # step 50 of plain DDP: 2 epochs of 23 steps, 4 steps of 64 samples
    fresh = QuorumCursor(1437, 32, 0, nominal=2)
    assert fresh.steps_left(end, 2) == 50
    assert fresh.steps_left(end, 1) == 2 * 45 + 8  # 1436 samples an epoch at 32 a step: 45 steps, the last short
    _, _, steps = trained_epochs(plain, end, random.Random(0), max_lanes=1, discard=0.0)  # one rank: twice the steps
    assert plain.done(end) and (plain.epoch, plain.position) == end
    assert steps == 2 * 45 + 8
    assert plain.steps_left(end, 2) == 0


def test_bad_states_and_sizes_are_refused_with_the_field_named():
    cursor = QuorumCursor(100, 8, 0, nominal=2)
    with pytest.raises(ConfigError, match="dealt its data per rank"):
        cursor.load_state_dict(ShardCursor(100, 0, 2, 8, 0).state_dict())
    with pytest.raises(ConfigError, match="seed=1"):
        cursor.load_state_dict({**QuorumCursor(100, 8, 1, nominal=2).state_dict()})
    with pytest.raises(ConfigError, match="cannot be sharded over 200 ranks"):
        QuorumCursor(100, 8, 0, nominal=200)
    with pytest.raises(ConfigError, match="batchSize"):
        QuorumCursor(100, 0, 0, nominal=2)
    with pytest.raises(ConfigError, match="cannot be dealt to 101 ranks"):
        cursor.block(101)
    block = cursor.block(2)
    cursor.advance(block)
    with pytest.raises(ValueError, match="not the cursor's next"):
        cursor.share(block, 0)


@pytest.mark.parametrize(("num_samples", "nominal", "batch"), [(1438, 2, 32), (100, 3, 7), (64, 2, 32)])
def test_seek_puts_a_cursor_where_a_fault_free_run_is_after_that_many_steps(num_samples, nominal, batch):
    """The migration of a fault-tolerant checkpoint of 2026-12-04 (no cursor in it: its place followed from the
    step): seek(step) is the state a cursor reaches by `step` committed steps of every nominal rank."""
    walked = QuorumCursor(num_samples, batch, seed=3, nominal=nominal)
    for step in range(3 * walked.steps_per_epoch + 2):
        sought = QuorumCursor(num_samples, batch, seed=3, nominal=nominal)
        sought.seek(step)
        assert sought.state_dict() == walked.state_dict(), step
        assert sought.nominal_step == walked.nominal_step == step
        walked.advance(walked.block(nominal))
