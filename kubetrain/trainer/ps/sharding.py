"""Which parameter-server shard holds which parameter: a pure function of names, sizes and shard count.

Workers and servers compute the same assignment from the same model, so it
never travels over the wire. Greedy longest-processing-time: the largest
tensor goes to the least-loaded shard (ties to the lower index). The heaviest
shard then holds at most the mean load plus one tensor, which is the best any
assignment of whole tensors can promise.
"""

from __future__ import annotations

from collections.abc import Mapping


def assign_shards(sizes: Mapping[str, int], shards: int) -> list[list[str]]:
    """The parameter names of each shard, in the order of `sizes` within a shard."""
    if shards < 1:
        raise ValueError(f"shards must be at least 1, got {shards}")
    loads = [0] * shards
    owner: dict[str, int] = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        target = min(range(shards), key=lambda i: (loads[i], i))
        owner[name] = target
        loads[target] += sizes[name]
    return [[name for name in sizes if owner[name] == i] for i in range(shards)]
