"""Error feedback loses nothing: sum(raw) - sum(transmitted) == residual, for every lossy codec."""

import pytest
import torch

from kubetrain.api.spec import Compression
from kubetrain.trainer import compression

LOSSY = [
    Compression(algorithm="FP16", min_tensor_bytes=0),
    Compression(algorithm="Int8", min_tensor_bytes=0),
    Compression(algorithm="TopK", ratio=0.01, min_tensor_bytes=0),
    Compression(algorithm="PowerSGD", rank=2, min_tensor_bytes=0),
]


@pytest.mark.parametrize("config", LOSSY, ids=[c.algorithm for c in LOSSY])
def test_residual_is_what_was_not_yet_transmitted(config):
    gen = torch.Generator().manual_seed(0)
    compressor = compression.GradientCompressor(config)
    raw_sum = torch.zeros(32, 40, dtype=torch.float64)
    sent_sum = torch.zeros(32, 40, dtype=torch.float64)
    for step in range(30):
        grad = torch.randn(32, 40, generator=gen)
        encoded = compressor.compress("w", grad, step)
        assert encoded.codec == config.algorithm
        raw_sum += grad.double()
        sent_sum += compression.decode(encoded.codec, encoded.payload, (32, 40), torch.float32).double()
    residual = compressor.residuals["w"].double()
    assert torch.allclose(raw_sum - sent_sum, residual, atol=1e-4)
    # The residual stays bounded: error feedback does not accumulate drift.
    assert residual.abs().max() < 10 * raw_sum.abs().max()


def test_topk_error_feedback_eventually_sends_every_coordinate():
    compressor = compression.GradientCompressor(Compression(algorithm="TopK", ratio=0.1, min_tensor_bytes=0))
    grad = torch.linspace(1.0, 2.0, 100)  # the small coordinates lose every single round to the large ones
    touched = torch.zeros(100, dtype=torch.bool)
    for step in range(40):
        encoded = compressor.compress("w", grad, step)
        touched |= compression.decode("TopK", encoded.payload, (100,), torch.float32) != 0
    assert touched.all()


def test_powersgd_warm_start_reuses_q_and_improves_the_approximation():
    gen = torch.Generator().manual_seed(4)
    matrix = torch.randn(64, 8, generator=gen) @ torch.randn(8, 64, generator=gen)
    algo = compression.ALGORITHMS["PowerSGD"](Compression(algorithm="PowerSGD", rank=2))
    state: dict = {}
    errors = []
    for _ in range(6):
        approx = compression.decode("PowerSGD", algo.encode(matrix, state), (64, 64), torch.float32)
        errors.append(float((approx - matrix).norm()))
    assert state["q"].shape == (64, 2)
    assert errors[-1] < errors[0]
