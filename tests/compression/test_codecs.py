"""Each codec decodes what it encodes, within its precision, and refuses payloads of the wrong size."""

import re

import pytest
import torch

from kubetrain.api.spec import Compression
from kubetrain.trainer import compression
from kubetrain.trainer.compression import ALGORITHMS, CompressionError

SHAPE = (64, 48)

# (codec, config, largest error allowed relative to max |x|)
ROUND_TRIPS = [
    ("None", Compression(), 0.0),
    ("FP16", Compression(algorithm="FP16"), 1e-3),
    ("Int8", Compression(algorithm="Int8"), 1 / 127),
]


@pytest.mark.parametrize("codec, config, tolerance", ROUND_TRIPS, ids=[c[0] for c in ROUND_TRIPS])
def test_codec_round_trip_stays_within_its_precision(codec, config, tolerance):
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1))
    payload = ALGORITHMS[codec](config).encode(x, {})
    y = compression.decode(codec, payload, SHAPE, torch.float32)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert (y - x).abs().max() <= tolerance * x.abs().max() + 1e-7


def test_topk_keeps_exactly_the_largest_magnitudes():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(2))
    payload = ALGORITHMS["TopK"](Compression(algorithm="TopK", ratio=0.05)).encode(x, {})
    y = compression.decode("TopK", payload, (1000,), torch.float32)
    kept = y.nonzero().flatten()
    assert set(kept.tolist()) == set(x.abs().topk(50).indices.tolist())
    assert torch.equal(y[kept], x[kept])
    assert payload.numel() == 50 * 8


def test_powersgd_is_exact_on_a_matrix_of_its_rank():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 2, generator=g) @ torch.randn(2, 48, generator=g)
    algo = ALGORITHMS["PowerSGD"](Compression(algorithm="PowerSGD", rank=2))
    payload = algo.encode(x, {})
    assert payload.numel() == 4 * 2 * (64 + 48)
    y = compression.decode("PowerSGD", payload, SHAPE, torch.float32)
    assert torch.allclose(y, x, atol=1e-4)


BAD_PAYLOADS = [
    ("None", torch.zeros(10, dtype=torch.uint8), (4,), "expected 16"),
    ("FP16", torch.zeros(10, dtype=torch.uint8), (4,), "expected 8"),
    ("Int8", torch.zeros(3, dtype=torch.uint8), (4,), "expected 8"),
    ("TopK", torch.zeros(12, dtype=torch.uint8), (4,), "8 bytes"),
    ("TopK", torch.tensor([9, 0, 0, 0, 0, 0, 0, 0], dtype=torch.uint8), (4,), "out of range"),
    ("PowerSGD", torch.zeros(30, dtype=torch.uint8), (4, 4), "4 * r * (m + n)"),
    ("PowerSGD", torch.zeros(32, dtype=torch.uint8), (8,), "2 or more dimensions"),
    ("Zstd", torch.zeros(4, dtype=torch.uint8), (1,), "unknown codec"),
]


@pytest.mark.parametrize("codec, payload, shape, message", BAD_PAYLOADS, ids=[f"{c[0]}-{c[3]}" for c in BAD_PAYLOADS])
def test_decode_refuses_a_payload_that_does_not_fit_the_shape(codec, payload, shape, message):
    with pytest.raises(CompressionError, match=re.escape(message)):
        compression.decode(codec, payload, shape, torch.float32)


CODEC_CHOICES = [
    ("small tensor travels raw", Compression(algorithm="TopK", min_tensor_bytes=1024), (16,), 10, "None"),
    ("large tensor is compressed", Compression(algorithm="TopK", min_tensor_bytes=1024), (1024,), 10, "TopK"),
    ("warm-up travels raw", Compression(algorithm="TopK", min_tensor_bytes=0, warmup_steps=5), (1024,), 4, "None"),
    ("after warm-up", Compression(algorithm="TopK", min_tensor_bytes=0, warmup_steps=5), (1024,), 5, "TopK"),
    ("PowerSGD skips vectors", Compression(algorithm="PowerSGD", min_tensor_bytes=0), (1024,), 0, "None"),
    ("PowerSGD skips a rank that saves nothing", Compression(algorithm="PowerSGD", rank=4, min_tensor_bytes=0), (4, 100), 0, "None"),
    ("PowerSGD on a matrix", Compression(algorithm="PowerSGD", min_tensor_bytes=0), (64, 64), 0, "PowerSGD"),
]


@pytest.mark.parametrize("config, shape, step, codec", [c[1:] for c in CODEC_CHOICES], ids=[c[0] for c in CODEC_CHOICES])
def test_compressor_picks_the_codec_by_size_warmup_and_shape(config, shape, step, codec):
    encoded = compression.GradientCompressor(config).compress("w", torch.randn(shape), step)
    assert encoded.codec == codec
    assert compression.decode(codec, encoded.payload, shape, torch.float32).shape == shape
