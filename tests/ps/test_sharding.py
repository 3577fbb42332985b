"""Parameters are balanced over the shards by bytes, each on exactly one shard, the same way every time."""

import pytest

from kubetrain.trainer.ps.sharding import assign_shards

CASES = [
    ("one shard holds all", {"a": 10, "b": 5}, 1, [["a", "b"]]),
    ("largest alone", {"w0": 100, "b0": 1, "w1": 60, "b1": 1, "w2": 40}, 2, [["w0", "b0"], ["w1", "b1", "w2"]]),
    ("more shards than tensors", {"a": 3, "b": 2}, 3, [["a"], ["b"], []]),
    ("ties go to the lower index", {"a": 1, "b": 1, "c": 1, "d": 1}, 2, [["a", "c"], ["b", "d"]]),
]


@pytest.mark.parametrize("sizes, shards, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_assignment_of_small_models(sizes, shards, expected):
    assert assign_shards(sizes, shards) == expected


@pytest.mark.parametrize("shards", [2, 3, 5, 8])
def test_heaviest_shard_is_within_one_tensor_of_the_mean(shards):
    sizes = {f"t{i}": (i * 7919) % 1000 + 1 for i in range(40)}
    assignment = assign_shards(sizes, shards)
    assert sorted(n for shard in assignment for n in shard) == sorted(sizes)
    loads = [sum(sizes[n] for n in shard) for shard in assignment]
    assert max(loads) <= sum(sizes.values()) / shards + max(sizes.values())
    # Membership depends on sizes and names only, not on the order the model lists them in.
    reordered = assign_shards(dict(reversed(list(sizes.items()))), shards)
    assert [set(shard) for shard in reordered] == [set(shard) for shard in assignment]

def test_zero_shards_is_refused():
    with pytest.raises(ValueError, match="at least 1, got 0"):
        assign_shards({"a": 1}, 0)
