"""Compressed pulls: a shard's copy of what each worker holds, the change since it, the Ternary and Sparse codecs."""

import math

import pytest
import torch

from kubetrain.api.spec import Compression
from kubetrain.trainer.compression import (
    ALGORITHMS,
    MAX_WORKER_COPY_BYTES,
    PULL_CODECS,
    CompressionError,
    PullCompressor,
    Sparse,
    Ternary,
    copy_crc32,
    decode,
)

SHAPES = {"w0": (128, 64), "b0": (128,), "w1": (10, 128), "b1": (10,)}
SHARD_BYTES = 4 * sum(math.prod(s) for s in SHAPES.values())


def params(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}


def pulls(algorithm: str = "TopK", budget: int = MAX_WORKER_COPY_BYTES, **fields) -> PullCompressor:
    return PullCompressor(Compression(algorithm=algorithm, min_tensor_bytes=0, **fields), SHARD_BYTES, budget)


def apply(copy: dict[str, torch.Tensor], reply) -> None:
    """What a worker does with a reply (Assembler with changes=True): None is the value, the rest a change."""
    for name, enc in reply.tensors.items():
        value = decode(enc.codec, enc.payload, SHAPES[name], torch.float32)
        if enc.codec == "None":
            copy[name] = value.clone()
        else:
            copy[name] += value


def payload_bytes(reply) -> int:
    return sum(e.payload.numel() for e in reply.tensors.values())


# --- the Ternary codec -------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(128, 64), (10,), (7, 3), (1,), (0,), (65,)])
def test_ternary_payload_is_a_bfloat16_scale_per_64_elements_and_five_elements_a_byte(shape):
    numel = math.prod(shape)
    payload = Ternary(Compression()).encode(torch.randn(shape), {})
    assert payload.numel() == 2 * -(-numel // 64) + -(-numel // 5)
    out = Ternary.decode(payload, shape, torch.float32)
    assert out.shape == torch.Size(shape)


def test_ternary_sends_each_element_as_minus_zero_or_plus_its_blocks_largest_magnitude():
    x = torch.randn(300)
    out = Ternary.decode(Ternary(Compression()).encode(x, {}), (300,), torch.float32)
    for start in range(0, 300, 64):
        block, sent = x[start:start + 64], out[start:start + 64]
        scale = float(block.abs().max().to(torch.bfloat16))
        assert set(sent.abs().unique().tolist()) <= {0.0, scale}
        assert torch.all((sent == 0) | (torch.sign(sent) == torch.sign(block)))


def test_ternary_rounding_is_unbiased_and_repeats_from_its_seed():
    codec, x = Ternary(Compression()), torch.randn(64) * 0.1
    state: dict = {}
    mean = sum(Ternary.decode(codec.encode(x, state), (64,), torch.float32) for _ in range(4000)) / 4000
    assert (mean - x).abs().max() < 0.02
    again = [codec.encode(x, {}) for _ in range(2)]
    assert torch.equal(again[0], again[1])


def test_ternary_keeps_an_all_zero_block_zero():
    x = torch.cat([torch.zeros(64), torch.ones(64)])
    out = Ternary.decode(Ternary(Compression()).encode(x, {}), (128,), torch.float32)
    assert torch.equal(out[:64], torch.zeros(64)) and torch.equal(out[64:], torch.ones(64))


@pytest.mark.parametrize("payload, message", [
    (torch.zeros(5, dtype=torch.uint8), "Ternary payload of 5 bytes"),
    (torch.cat([torch.zeros(2, dtype=torch.uint8), torch.full((2,), 243, dtype=torch.uint8)]),
     "not five base-3 digits"),
])
def test_ternary_refuses_a_payload_it_cannot_decode(payload, message):
    with pytest.raises(CompressionError, match=message):
        Ternary.decode(payload, (10,), torch.float32)


# --- the Sparse codec ---------------------------------------------------------------------------


def sparse(shape, dtype=torch.float32, every: int = 50) -> torch.Tensor:
    x = torch.zeros(shape, dtype=dtype)
    x.view(-1)[::every] = torch.randn(x.view(-1)[::every].shape).to(dtype)
    return x


@pytest.mark.parametrize("shape, dtype, index_bytes", [
    ((128, 64), torch.float32, 2), ((1 << 16,), torch.float32, 2), (((1 << 16) + 1,), torch.float32, 4),
    ((300, 300), torch.float16, 4), ((7, 3), torch.bfloat16, 2), ((0,), torch.float32, 2),
])
def test_sparse_sends_each_nonzero_element_exactly_with_its_index(shape, dtype, index_bytes):
    x = sparse(shape, dtype)
    nonzero = int(x.count_nonzero())
    payload = Sparse(Compression()).encode(x, {})
    element = torch.empty((), dtype=dtype).element_size()
    assert payload.numel() == nonzero * (index_bytes + element) == Sparse.payload_bytes(x.numel(), nonzero, dtype)
    out = decode("Sparse", payload, shape, dtype)
    assert out.dtype == dtype and torch.equal(out, x)


def test_sparse_of_a_tensor_without_a_nonzero_element_is_empty_and_decodes_to_zeros():
    payload = Sparse(Compression()).encode(torch.zeros(10), {})
    assert payload.numel() == 0 and torch.equal(decode("Sparse", payload, (10,), torch.float32), torch.zeros(10))


def sparse_payload(values: list[float], indices: list[int], width: int = 2) -> torch.Tensor:
    raw = torch.tensor(values, dtype=torch.float32).view(torch.uint8)
    index = torch.tensor(indices, dtype=torch.int32).view(torch.uint8).reshape(-1, 4)[:, :width].reshape(-1)
    return torch.cat([raw, index])


@pytest.mark.parametrize("payload, message", [
    (torch.zeros(5, dtype=torch.uint8), "Sparse payload of 5 bytes is not 6 bytes"),
    (sparse_payload([1.0], [10]), r"Sparse index out of range \[0, 10\)"),
    (sparse_payload([1.0, 2.0], [4, 4]), "must ascend, each once"),
    (sparse_payload([1.0, 2.0], [5, 4]), "must ascend, each once"),
    (sparse_payload([1.0] * 7, list(range(7))), "at most 40 bytes in all"),  # larger than the tensor itself
])
def test_sparse_refuses_a_payload_it_cannot_decode(payload, message):
    with pytest.raises(CompressionError, match=message):
        decode("Sparse", payload, (10,), torch.float32)


# --- the shard's copies --------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm, codec", [
    ("FP16", "FP16"), ("Int8", "Int8"), ("TopK", "Ternary"), ("PowerSGD", "Ternary"),
])
def test_each_lossy_algorithm_pulls_the_change_and_the_worker_holds_the_shards_copy_bit_for_bit(algorithm, codec):
    shard = pulls(algorithm)
    first = shard.encode(0, 0, params(0), worker_step=0)
    assert first.whole and first.copy and all(e.codec == "None" for e in first.tensors.values())
    mine = {n: torch.zeros(s) for n, s in SHAPES.items()}
    apply(mine, first)
    second = shard.encode(0, first.copy, params(1), worker_step=1)
    assert not second.whole and second.copy not in (0, first.copy)
    assert {e.codec for e in second.tensors.values()} == {codec}
    apply(mine, second)
    held = shard.copies[0].tensors
    assert all(torch.equal(mine[n], held[n]) for n in SHAPES)  # exactly what the shard believes it sent
    assert copy_crc32(mine[n] for n in sorted(mine)) == second.crc32
    assert (shard.whole_pulls, shard.compressed_pulls) == (1, 1)


def test_a_sparse_change_is_pulled_exactly_as_sparse_and_a_dense_one_as_the_pull_codec():
    """A TopK shard under momentum correction changes few elements a step: those go exact, in fewer bytes."""
    shard = pulls("TopK")
    before = params(0)
    first = shard.encode(0, 0, before, worker_step=0)
    mine = {n: t.clone() for n, t in before.items()}
    after = {n: t + sparse(t.shape, every=64) for n, t in before.items()}  # 1 element in 64 changed
    after["w1"] = params(2)["w1"]  # this one changed everywhere
    reply = shard.encode(0, first.copy, after, worker_step=1)
    codecs = {n: e.codec for n, e in reply.tensors.items()}
    # b1's one changed element of 10: 6 bytes exact against Ternary's 4 for the whole tensor.
    assert codecs == {"w0": "Sparse", "b0": "Sparse", "w1": "Ternary", "b1": "Ternary"}
    ternary = Ternary(Compression())
    for name in ("w0", "b0"):
        assert reply.tensors[name].payload.numel() < ternary.encoded_bytes(after[name].numel(), torch.float32)
    apply(mine, reply)
    assert all(torch.equal(mine[n], shard.copies[0].tensors[n]) for n in SHAPES)
    assert all(torch.equal(mine[n], after[n]) for n in ("w0", "b0"))  # exact: nothing waits in the copy
    assert not torch.equal(mine["w1"], after["w1"])  # Ternary's rounding waits in the shard's copy
    unchanged = shard.encode(0, reply.copy, shard.copies[0].tensors, worker_step=2)
    assert all(e.codec == "Sparse" and e.payload.numel() == 0 for e in unchanged.tensors.values())


def test_none_pulls_the_parameters_whole_and_keeps_no_copy():
    shard = pulls("None")
    assert not shard.enabled
    assert PULL_CODECS.keys() <= ALGORITHMS.keys() and "None" not in PULL_CODECS


def test_topk_pulls_are_at_least_15x_smaller_than_whole_ones():
    shard = pulls("TopK", ratio=0.01)
    whole = shard.encode(0, 0, params(0), worker_step=0)
    change = shard.encode(0, whole.copy, params(1), worker_step=1)
    assert payload_bytes(whole) / payload_bytes(change) >= 15, (payload_bytes(whole), payload_bytes(change))


def test_error_feedback_brings_the_workers_copy_to_parameters_that_stop_changing():
    shard, target = pulls("TopK"), params(1)
    reply = shard.encode(0, 0, params(0), worker_step=0)
    mine = {n: torch.zeros(s) for n, s in SHAPES.items()}
    apply(mine, reply)
    lags = []
    for step in range(1, 60):
        reply = shard.encode(0, reply.copy, target, worker_step=step)
        apply(mine, reply)
        lags.append(max(float((mine[n] - target[n]).abs().max()) for n in SHAPES))
    assert lags[-1] < 1e-2 * lags[0], lags[::10]  # what one pull drops, a later one sends


@pytest.mark.parametrize("case", ["a restarted worker (no copy)", "a copy this shard did not send",
                                  "warm-up", "the final pull"])
def test_a_pull_is_whole_and_exact_for(case):
    shard = pulls("TopK", warmup_steps=5)
    first = shard.encode(0, 0, params(0), worker_step=5)
    have, step, final = {
        "a restarted worker (no copy)": (0, 6, False),
        "a copy this shard did not send": (first.copy ^ 1, 6, False),
        "warm-up": (first.copy, 4, False),
        "the final pull": (first.copy, 6, True),
    }[case]
    reply = shard.encode(0, have, params(1), worker_step=step, final=final)
    assert reply.whole and all(e.codec == "None" for e in reply.tensors.values())
    mine: dict = {}
    apply(mine, reply)
    assert all(torch.equal(mine[n], params(1)[n]) for n in SHAPES)
    if final:  # nothing follows a final pull: its copy is dropped
        assert reply.copy == 0 and 0 not in shard.copies


def test_workers_past_the_copy_budget_get_whole_pulls_and_the_first_keep_theirs():
    shard = pulls("TopK", budget=2 * SHARD_BYTES + SHARD_BYTES // 2)  # room for two copies, not three
    assert shard.slots == 2
    replies = {w: shard.encode(w, 0, params(0), worker_step=0) for w in range(3)}
    assert replies[0].copy and replies[1].copy and replies[2].copy == 0
    assert set(shard.copies) == {0, 1}
    again = {w: shard.encode(w, replies[w].copy, params(1), worker_step=1) for w in range(3)}
    assert not again[0].whole and not again[1].whole and again[2].whole and again[2].copy == 0
    # A worker already holding a slot keeps it across a restart (its whole pull replaces its copy).
    assert shard.encode(1, 0, params(2), worker_step=0).copy != 0
