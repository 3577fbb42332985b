"""Bad input on the wire gets a clear gRPC status; the shard keeps serving, its parameters unchanged.

The calls come from the generated stub (plain protobuf, no kubetrain transport)
against a real shard server on loopback.
"""

import grpc
import pytest
import torch

from cluster import TOKEN, shard_checkpoints
from helpers.net import free_port
from kubetrain.trainer.ps import ps_pb2 as pb
from kubetrain.trainer.ps import ps_pb2_grpc
from kubetrain.trainer.ps.server import ParameterShard, ShardConfig, build_server
from kubetrain.trainer.ps.transport import MAX_MESSAGE_BYTES, TOKEN_KEY

PARAMS = {"w": torch.arange(12, dtype=torch.float32).reshape(4, 3), "b": torch.ones(3)}
AUTH = ((TOKEN_KEY, TOKEN),)


@pytest.fixture
def shard(tmp_path):
    config = ShardConfig(replica="ps-0", workers=1, aggregation="Sync", sync_timeout=5.0, max_staleness=4,
                         max_steps=None, interval_steps=1000, chunk_bytes=1 << 20)
    shard = ParameterShard(config, PARAMS, lambda p: torch.optim.SGD(p, lr=0.1),
                           shard_checkpoints(tmp_path))
    server = build_server(shard, TOKEN, max_workers=8)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield shard, ps_pb2_grpc.ParameterShardStub(channel), ps_pb2_grpc.CoordinatorStub(channel)
    channel.close()
    server.stop(None)


def piece(name="w", dtype="float32", shape=(4, 3), data=None, **fields):
    data = torch.zeros(shape).numpy().tobytes() if data is None else data
    fields = {"total_bytes": len(data), "offset": 0, "length": len(data), "codec": "None", **fields}
    return pb.TensorPiece(name=name, dtype=dtype, shape=shape, **fields), data


def push_frames(pieces, worker=0, worker_step=1, base_step=0, ps_incarnation=0):
    header = pb.PushHeader(worker=worker, incarnation=7, worker_step=worker_step, base_step=base_step,
                           ps_incarnation=ps_incarnation)
    return [pb.Frame(push=header, pieces=[p for p, _ in pieces], data=b"".join(d for _, d in pieces))]


def good_pieces(value=1.0):
    return [piece("w", data=torch.full((4, 3), value).numpy().tobytes()),
            piece("b", shape=(3,), data=torch.full((3,), value).numpy().tobytes())]


def pulled(stub) -> dict[str, torch.Tensor]:
    frames = list(stub.Pull(pb.PullRequest(worker=0), metadata=AUTH, timeout=5))
    data = b"".join(f.data for f in frames)
    out, pos = {}, 0
    for p in (p for f in frames for p in f.pieces):
        out[p.name] = torch.frombuffer(bytearray(data[pos : pos + p.length]), dtype=torch.float32).reshape(tuple(p.shape))
        pos += p.length
    return out


def test_a_good_push_is_applied_once_even_when_retried(shard):
    state, stub, _ = shard
    first = stub.Push(iter(push_frames(good_pieces())), metadata=AUTH, timeout=5)
    retry = stub.Push(iter(push_frames(good_pieces())), metadata=AUTH, timeout=5)
    assert (first.outcome, retry.outcome) == (pb.PushReply.APPLIED, pb.PushReply.DUPLICATE)
    assert state.step == 1
    assert torch.allclose(pulled(stub)["w"], PARAMS["w"] - 0.1)


BAD_CALLS = [
    ("unknown tensor", push_frames([piece("v"), *good_pieces()[1:]]), "INVALID_ARGUMENT", "unknown tensor 'v'"),
    ("wrong dtype", push_frames([piece(dtype="float64", data=bytes(96)), good_pieces()[1]]), "INVALID_ARGUMENT", "dtype 'float64'"),
    ("wrong shape", push_frames([piece(shape=(3, 4)), good_pieces()[1]]), "INVALID_ARGUMENT", "shape [3, 4]"),
    ("truncated chunk", push_frames([piece(data=bytes(40), total_bytes=48, length=48), good_pieces()[1]]),
     "INVALID_ARGUMENT", "truncated frame"),
    ("missing last chunk", push_frames([piece(data=bytes(24), total_bytes=48, length=24), good_pieces()[1]]),
     "INVALID_ARGUMENT", "truncated: got 24 of 48 bytes"),
    ("tensor missing", push_frames(good_pieces()[:1]), "INVALID_ARGUMENT", "lacks 1 of the shard's 2 tensors"),
    ("oversized chunk", push_frames([piece(data=bytes(MAX_MESSAGE_BYTES))]), "RESOURCE_EXHAUSTED", ""),
    ("step from the future", push_frames(good_pieces(), base_step=5), "FAILED_PRECONDITION", "from the future"),
    ("parameters of a previous incarnation", push_frames(good_pieces(), ps_incarnation=1234),
     "FAILED_PRECONDITION", "restarted"),
    ("unknown worker", push_frames(good_pieces(), worker=3), "INVALID_ARGUMENT", "worker 3 is outside"),
    ("no push header", [pb.Frame(pieces=[p for p, _ in good_pieces()])], "INVALID_ARGUMENT", "PushHeader"),
    ("bad codec payload", push_frames([piece(codec="TopK", data=bytes(12)), good_pieces()[1]]),
     "INVALID_ARGUMENT", "TopK payload of 12 bytes"),
]


@pytest.mark.parametrize("frames, code, message", [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_bad_push_is_refused_and_leaves_the_shard_unchanged(shard, frames, code, message):
    state, stub, _ = shard
    before = pulled(stub)
    with pytest.raises(grpc.RpcError) as err:
        stub.Push(iter(frames), metadata=AUTH, timeout=5)
    assert err.value.code().name == code
    assert message in err.value.details()
    assert state.step == 0 and not state.pending
    after = pulled(stub)
    assert all(torch.equal(before[n], after[n]) for n in PARAMS)
    # Still serving: a good push goes through.
    assert stub.Push(iter(push_frames(good_pieces())), metadata=AUTH, timeout=5).outcome == pb.PushReply.APPLIED


TOKENS = [("missing", ()), ("wrong", ((TOKEN_KEY, "guess"),))]


@pytest.mark.parametrize("metadata", [t[1] for t in TOKENS], ids=[t[0] for t in TOKENS])
def test_every_method_refuses_a_missing_or_wrong_token(shard, metadata):
    state, stub, coordinator = shard
    calls = [
        lambda: list(stub.Pull(pb.PullRequest(worker=0), metadata=metadata, timeout=5)),
        lambda: stub.Push(iter(push_frames(good_pieces())), metadata=metadata, timeout=5),
        lambda: stub.Status(pb.StatusRequest(), metadata=metadata, timeout=5),
        lambda: stub.Finish(pb.FinishRequest(worker=0), metadata=metadata, timeout=5),
    ]
    for call in calls:
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert TOKEN_KEY in err.value.details()
    assert state.step == 0 and not state.workers[0].finished
    assert stub.Status(pb.StatusRequest(), metadata=AUTH, timeout=5).step == 0


def test_pull_of_an_unknown_worker_is_refused(shard):
    _, stub, _ = shard
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Pull(pb.PullRequest(worker=9), metadata=AUTH, timeout=5))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
