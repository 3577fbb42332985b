"""Momentum correction for TopK (Deep Gradient Compression): the worker keeps the velocity, the shard none."""

import pytest
import torch

from kubetrain.api.spec import Compression, Optimizer
from kubetrain.trainer import compression
from kubetrain.trainer.models import build_optimizer
from kubetrain.trainer.ps.job import shard_optimizer

TOPK = Compression(algorithm="TopK", ratio=0.05, min_tensor_bytes=0)
SGD = Optimizer(name="sgd", learning_rate=0.1, momentum=0.9)
SHAPE = (16, 25)


def sent(encoded: compression.Encoded, shape=SHAPE) -> torch.Tensor:
    return compression.decode(encoded.codec, encoded.payload, shape, torch.float32)


def test_sent_plus_kept_is_the_momentum_accumulated_gradient_and_sent_coordinates_are_masked():
    gen = torch.Generator().manual_seed(0)
    compressor = compression.GradientCompressor(TOPK, SGD)
    velocity = torch.zeros(SHAPE)
    residual = torch.zeros(SHAPE)
    for step in range(30):
        grad = torch.randn(SHAPE, generator=gen)
        encoded = compressor.compress("w", grad, step)
        assert encoded.codec == "TopK"
        out = sent(encoded)
        # The maths from the previous state: u = m u + g, v = v + u; v is split into sent and kept.
        velocity = SGD.momentum * velocity + grad
        accumulated = residual + velocity
        assert torch.equal(out + compressor.residuals["w"], accumulated)
        mask = out != 0
        assert int(mask.sum()) == 20  # 5% of 400
        # TopK sent the largest magnitudes of v, and masking zeroed velocity and residual there alone.
        assert out[mask].abs().min() >= accumulated[~mask].abs().max()
        assert not compressor.residuals["w"][mask].any() and not compressor.velocities["w"][mask].any()
        assert torch.equal(compressor.velocities["w"][~mask], velocity[~mask])
        velocity = compressor.velocities["w"].clone()
        residual = compressor.residuals["w"].clone()


def test_weight_decay_goes_into_the_velocity_on_the_worker():
    optimizer = Optimizer(name="sgd", learning_rate=0.1, momentum=0.9, weight_decay=0.01)
    param = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1))
    grad = torch.randn(SHAPE, generator=torch.Generator().manual_seed(2))
    compressor = compression.GradientCompressor(TOPK, optimizer, {"w": param})
    out = sent(compressor.compress("w", grad, 0))
    assert torch.equal(out + compressor.residuals["w"], grad + 0.01 * param)
    with pytest.raises(ValueError, match="pass the worker's parameters"):
        compression.GradientCompressor(TOPK, optimizer)


def test_dense_steps_with_a_plain_sgd_shard_are_sgd_with_momentum_exactly():
    # During warm-up everything goes, nothing is masked: worker velocity + the shard's momentum-0
    # group must be the job's SGD (momentum and weight decay) step for step.
    optimizer = Optimizer(name="sgd", learning_rate=0.05, momentum=0.9, weight_decay=0.01)
    config = Compression(algorithm="TopK", ratio=0.01, min_tensor_bytes=0, warmup_steps=1000)
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(40, 16, generator=gen), torch.randn(40, generator=gen)
    start = torch.randn(16, generator=gen)

    def gradient(p: torch.Tensor) -> torch.Tensor:
        return 2 * a.T @ (a @ p - b) / len(b)

    reference = torch.nn.Parameter(start.clone())
    sgd = build_optimizer([reference], optimizer)
    shard = torch.nn.Parameter(start.clone())
    plain = shard_optimizer([shard], optimizer, config)
    worker_copy = start.clone()
    compressor = compression.GradientCompressor(config, optimizer, {"p": worker_copy})
    for step in range(25):
        reference.grad = gradient(reference.detach())
        sgd.step()
        encoded = compressor.compress("p", gradient(worker_copy), step)
        assert encoded.codec == "None"
        shard.grad = sent(encoded, (16,))
        plain.step()
        worker_copy.copy_(shard.detach())  # the worker's pull
    assert torch.allclose(shard, reference, rtol=1e-5, atol=1e-6)
    assert not torch.equal(reference.detach(), start)


SHARD_OPTIMIZERS = [
    # (name, compression, optimizer, momentum of each tensor's group: 8x8 matrix, 4-element bias)
    ("TopK under SGD with momentum: no momentum on the shard", TOPK, SGD, (0.0, 0.0)),
    ("TopK skips small tensors: they keep the shard's momentum",
     Compression(algorithm="TopK", ratio=0.01, min_tensor_bytes=256), SGD, (0.0, 0.9)),
    ("TopK under Adam: unchanged", TOPK, Optimizer(name="adam"), (None, None)),
    ("TopK under SGD without momentum: unchanged", TOPK, Optimizer(momentum=0.0), (0.0, 0.0)),
    ("None: unchanged", Compression(), SGD, (0.9, 0.9)),
    ("FP16: unchanged", Compression(algorithm="FP16", min_tensor_bytes=0), SGD, (0.9, 0.9)),
    ("Int8: unchanged", Compression(algorithm="Int8", min_tensor_bytes=0), SGD, (0.9, 0.9)),
    ("PowerSGD: unchanged", Compression(algorithm="PowerSGD", min_tensor_bytes=0), SGD, (0.9, 0.9)),
]


@pytest.mark.parametrize("config, optimizer, momenta", [c[1:] for c in SHARD_OPTIMIZERS],
                         ids=[c[0] for c in SHARD_OPTIMIZERS])
def test_the_shard_drops_momentum_exactly_for_the_tensors_the_worker_corrects(config, optimizer, momenta):
    params = [torch.nn.Parameter(torch.zeros(8, 8)), torch.nn.Parameter(torch.zeros(4))]
    built = shard_optimizer(params, optimizer, config)
    group_of = {id(p): g for g in built.param_groups for p in g["params"]}
    assert [group_of[id(p)].get("momentum") for p in params] == list(momenta)
    corrected = [compression.momentum_corrected(config, optimizer, p) for p in params]
    assert corrected == [m == 0.0 and optimizer.momentum > 0 and optimizer.name == "sgd" for m in momenta]
    if not any(corrected):
        assert len(built.param_groups) == 1  # the job's optimizer as before: its checkpoints load as before
    # The worker agrees: velocities exactly for the corrected tensors.
    compressor = compression.GradientCompressor(config, optimizer)
    for i, p in enumerate(params):
        compressor.compress(str(i), torch.randn(p.shape), 0)
    assert sorted(compressor.velocities) == [str(i) for i, c in enumerate(corrected) if c]


@pytest.mark.parametrize("algorithm", ["FP16", "Int8", "PowerSGD"])
def test_other_codecs_send_the_same_bytes_with_or_without_the_optimizer(algorithm):
    config = Compression(algorithm=algorithm, min_tensor_bytes=0)
    gen = torch.Generator().manual_seed(5)
    plain, given = compression.GradientCompressor(config), compression.GradientCompressor(config, SGD)
    for step in range(5):
        grad = torch.randn(SHAPE, generator=gen)
        assert torch.equal(plain.compress("w", grad, step).payload, given.compress("w", grad, step).payload)
    assert given.velocities == {}


def test_a_checkpoint_of_the_jobs_optimizer_does_not_put_the_momentum_back():
    # Written before momentum correction: one group with the job's momentum 0.9 and its buffers.
    before = torch.nn.Parameter(torch.ones(8, 8))
    old = build_optimizer([before], SGD)
    before.grad = torch.ones(8, 8)
    old.step()
    shard = torch.nn.Parameter(before.detach().clone())
    now = shard_optimizer([shard], SGD, TOPK)
    now.load_state_dict(old.state_dict())
    assert now.param_groups[0]["momentum"] == 0.0 and now.param_groups[0]["lr"] == SGD.learning_rate
    shard.grad = torch.ones(8, 8)
    now.step()
    assert torch.allclose(shard, before - SGD.learning_rate)  # plain SGD: the old buffer is not applied
