"""Frames carry tensors intact: chunked, bucketed, readable by plain protobuf, checked on receipt."""

import logging

import grpc
import pytest
import torch

from kubetrain.trainer.compression import as_bytes
from kubetrain.trainer.ps import ps_pb2 as pb
from kubetrain.trainer.ps import transport
from kubetrain.trainer.ps.transport import (
    Assembler,
    Expected,
    OutTensor,
    WireError,
    decode_frame,
    encode_frame,
    frames_for,
)

TENSORS = {
    "big": torch.randn(300, 100),  # 120,000 bytes: several chunks
    "small0": torch.randn(10),
    "small1": torch.randn(3, 4),
    "empty": torch.randn(0),
}


def out_tensors(tensors=TENSORS):
    return [OutTensor(n, "float32", tuple(t.shape), "None", as_bytes(t)) for n, t in tensors.items()]


def send(tensors=TENSORS, chunk_bytes=50_000, first=None):
    return [encode_frame(f) for f in frames_for(out_tensors(tensors), chunk_bytes, first)]


def receive(messages, expected=None):
    expected = expected or {n: Expected.of(t) for n, t in TENSORS.items()}
    assembler = Assembler(expected, scratch={})
    for message in messages:
        assembler.add(decode_frame(message))
    return assembler.finish()


def test_tensors_arrive_bit_exact_in_chunks_with_small_ones_bucketed():
    messages = send(first=pb.Frame(pull=pb.PullHeader(step=7)))
    assert len(messages) == 3  # 120,000 + 172 bytes in chunks of 50,000
    assert max(len(m) for m in messages) < 50_000 + 1_000
    assert decode_frame(messages[0]).header.pull.step == 7
    got = receive(messages)
    for name, tensor in TENSORS.items():
        assert torch.equal(got[name], tensor), name


def test_plain_protobuf_reads_and_writes_the_same_bytes():
    message = send(TENSORS, chunk_bytes=1 << 20)[0]
    parsed = pb.Frame.FromString(message)
    assert [p.name for p in parsed.pieces] == list(TENSORS)
    assert len(parsed.data) == sum(t.numel() * 4 for t in TENSORS.values())
    # A generated-code sender (fields in number order) is read by decode_frame as well.
    assert torch.equal(receive([parsed.SerializeToString()])["small1"], TENSORS["small1"])


def test_raw_payloads_land_directly_in_the_target_tensor():
    target = torch.zeros(300, 100)
    assembler = Assembler({"big": Expected.of(target)}, scratch={}, direct={"big": target})
    for message in send({"big": TENSORS["big"]}):
        assembler.add(decode_frame(message))
    assert assembler.finish()["big"].data_ptr() == target.data_ptr()
    assert torch.equal(target, TENSORS["big"])


def test_scratch_buffers_are_reused_across_streams():
    scratch: dict = {}
    expected = {n: Expected.of(t) for n, t in TENSORS.items()}
    pointers = []
    for _ in range(2):
        assembler = Assembler(expected, scratch)
        for message in send():
            assembler.add(decode_frame(message))
        pointers.append(assembler.finish()["big"].data_ptr())
    assert pointers[0] == pointers[1]


def tamper(message: bytes, **changes) -> bytes:
    frame = pb.Frame.FromString(message)
    for key, value in changes.items():
        if key == "data":
            frame.data = value(frame.data)
        else:
            piece = frame.pieces[0]
            if key == "shape":
                del piece.shape[:]
                piece.shape.extend(value)
            else:
                setattr(piece, key, value)
    return frame.SerializeToString()


BAD_STREAMS = [
    ("unknown name", lambda m: [tamper(m[0], name="nope")] + m[1:], "unknown tensor 'nope'"),
    ("wrong dtype", lambda m: [tamper(m[0], dtype="float64")] + m[1:], "dtype 'float64' does not match"),
    ("wrong shape", lambda m: [tamper(m[0], shape=[100, 300])] + m[1:], "shape [100, 300] does not match"),
    ("unknown codec", lambda m: [tamper(m[0], codec="Zstd")] + m[1:], "unknown codec 'Zstd'"),
    ("data shorter than declared", lambda m: [tamper(m[0], data=lambda d: d[:-10])] + m[1:], "truncated frame"),
    ("missing middle chunk", lambda m: [m[0], m[2]], "expected 50000"),
    ("last chunk missing", lambda m: m[:1], "lacks"),
    ("oversized total", lambda m: [tamper(m[0], total_bytes=10**9)] + m[1:], "oversized"),
    ("garbage", lambda m: [b"\xff\xff\xff"], "malformed frame"),
]


@pytest.mark.parametrize("mutate, message", [c[1:] for c in BAD_STREAMS], ids=[c[0] for c in BAD_STREAMS])
def test_bad_streams_are_refused_with_a_clear_message(mutate, message):
    with pytest.raises(WireError, match=message.replace("[", r"\[").replace("]", r"\]")) as err:
        receive(mutate(send()))
    assert err.value.code.name == "INVALID_ARGUMENT"


class Unavailable(grpc.RpcError):
    """What a channel raises for a peer that does not listen (yet)."""

    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "failed to connect to all addresses"


def flaky(failures: int):
    calls = []

    def call():
        calls.append(1)
        if len(calls) <= failures:
            raise Unavailable()
        return "answered"
    return call


@pytest.mark.parametrize("warn_after, level",
                         [(transport.PEER_AWAY_WARN_SECONDS, logging.INFO), (0.0, logging.WARNING)])
def test_a_peer_that_answers_within_the_bound_is_waited_for_at_info_and_past_it_at_warning(
        monkeypatch, caplog, warn_after, level):
    """The workers of a job start beside their parameter servers: waiting for one is normal (INFO), and a
    WARNING only once the peer has been away past PEER_AWAY_WARN_SECONDS."""
    monkeypatch.setattr(transport, "PEER_AWAY_WARN_SECONDS", warn_after)
    caplog.set_level(logging.INFO, logger=transport.__name__)
    backoff = transport.Backoff(base=0.0, cap=0.0)
    assert transport.call_with_retry(flaky(5), "Register to peer", backoff) == "answered"
    waits = [r for r in caplog.records if "retrying" in r.getMessage()]
    assert [r.levelno for r in waits] == [level], [r.getMessage() for r in caplog.records]
    assert "UNAVAILABLE" in waits[0].getMessage()
    assert any("answered after 5 retries" in r.getMessage() and r.levelno == logging.INFO for r in caplog.records)


def test_a_peer_away_past_the_budget_is_raised():
    backoff = transport.Backoff(base=0.0, cap=0.0, budget=0.0)
    with pytest.raises(Unavailable):
        transport.call_with_retry(flaky(2), "Register to peer", backoff)
