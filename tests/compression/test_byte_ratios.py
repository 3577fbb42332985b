"""Counted bytes: TopK at 1% sends >= 40x fewer than None; PowerSGD matches mn / (r (m + n))."""

import pytest
import torch

from kubetrain.api.spec import Compression
from kubetrain.trainer.compression import GradientCompressor

# An MLP's gradients (weights and biases); the biases fall under minTensorBytes and travel raw.
SHAPES = {"w0": (512, 256), "b0": (512,), "w1": (256, 512), "b1": (256,), "w2": (10, 256), "b2": (10,)}


def counted_bytes(config: Compression, steps: int = 3) -> tuple[int, int]:
    compressor = GradientCompressor(config)
    gen = torch.Generator().manual_seed(0)
    for step in range(steps):
        for name, shape in SHAPES.items():
            compressor.compress(name, torch.randn(shape, generator=gen), step)
    return compressor.raw_bytes, compressor.compressed_bytes


def test_topk_at_one_percent_sends_at_least_40x_fewer_bytes_than_none():
    raw, none_bytes = counted_bytes(Compression(algorithm="None"))
    _, topk_bytes = counted_bytes(Compression(algorithm="TopK", ratio=0.01, min_tensor_bytes=4096))
    assert none_bytes == raw
    assert none_bytes / topk_bytes >= 40, (none_bytes, topk_bytes)


@pytest.mark.parametrize("m, n, rank", [(512, 256, 2), (256, 512, 4), (300, 64, 1), (128, 128, 8)])
def test_powersgd_ratio_matches_mn_over_r_m_plus_n(m, n, rank):
    compressor = GradientCompressor(Compression(algorithm="PowerSGD", rank=rank, min_tensor_bytes=0))
    for step in range(3):
        compressor.compress("w", torch.randn(m, n), step)
    expected = m * n / (rank * (m + n))
    assert abs(compressor.ratio - expected) / expected <= 0.10, (compressor.ratio, expected)
