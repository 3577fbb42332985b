"""Gradient compression between workers and parameter servers: the algorithms and their registry.

An `Algorithm` turns one tensor into a payload of bytes (`encode`) and back
(`decode`). Decoding needs only the payload, the shape and the dtype, never
the sender's settings, so a parameter server decodes whatever codec a piece
names. `GradientCompressor` is what a worker holds: it picks the codec per
tensor (none below `minTensorBytes` or during `warmupSteps`), keeps the error
feedback residual of every lossy codec, and counts raw and compressed bytes.

Error feedback (Seide et al. 2014; Karimireddy et al. 2019): what a lossy
codec drops this step is added to the next step's gradient, so over the run
sum(raw gradients) - sum(transmitted gradients) == residual, and nothing is
lost, only delayed. Without it TopK at 1% does not converge.

Momentum correction (Lin et al. 2018, Deep Gradient Compression), for TopK
under SGD with momentum: the worker keeps the velocity u = m * u + g of each
tensor TopK carries and feeds u, not g, to error feedback; the shard applies
what arrives with plain SGD (its optimizer has momentum 0 for those tensors:
`momentum_corrected`, kubetrain/trainer/ps/job.py). Sent plus kept is then the sum of
the velocities, as momentum SGD applies it, only delayed; and where TopK sends
a coordinate, its velocity restarts from zero (momentum factor masking): the
momentum of gradients that waited tens of steps is stale. With the momentum
on the shard instead, a coordinate's gradients wait in the residual and then
enter the shard's momentum as one lump, which it goes on applying for tens of
steps: TopK 1% on the quickstart, seeds 0 to 7, averaged 2.6 points under
None; corrected and masked, 1.0 (docs/benchmarks-history.md).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
import random
import threading
import zlib
from collections.abc import Iterable, Mapping
from typing import ClassVar

import torch

from kubetrain.api.spec import Compression, Optimizer


class CompressionError(ValueError):
    """A payload that does not decode to the tensor its header describes (bad input on the wire)."""


@dataclass
class Encoded:
    """One encoded tensor: the codec's name and its payload, a flat uint8 tensor."""

    codec: str
    payload: torch.Tensor


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a tensor's memory (a copy only when it is not contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _view(payload: torch.Tensor, dtype: torch.dtype, count: int, offset: int = 0) -> torch.Tensor:
    size = torch.empty((), dtype=dtype).element_size()
    return payload[offset : offset + count * size].view(dtype)


def _expect_length(codec: str, payload: torch.Tensor, expected: int, shape: tuple[int, ...]) -> None:
    if payload.numel() != expected:
        raise CompressionError(
            f"{codec} payload of {payload.numel()} bytes does not fit a tensor of shape {list(shape)}: expected {expected}"
        )


class Algorithm(ABC):
    """A compression algorithm: `encode` on the sender, `decode` (a classmethod) on the receiver."""

    name: ClassVar[str]
    lossy: ClassVar[bool] = True
    corrects_momentum: ClassVar[bool] = False
    """Under SGD with momentum the worker keeps the velocity and the shard applies what arrives without
    momentum (module docstring): for codecs that hold most coordinates back for many steps."""

    def __init__(self, config: Compression):
        self.config = config

    def applies(self, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
        """Whether encoding a tensor of this shape saves bytes; otherwise it travels as None."""
        return dtype.is_floating_point

    def encoded_bytes(self, numel: int, dtype: torch.dtype) -> int | None:
        """The payload's length for any tensor of numel elements of dtype; None where it depends on the values."""
        return None

    @abstractmethod
    def encode(self, tensor: torch.Tensor, state: dict) -> torch.Tensor:
        """The payload of `tensor`; `state` is this tensor's own dict, kept across steps."""

    @classmethod
    @abstractmethod
    def decode(cls, payload: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The tensor of `shape` and `dtype` a payload stands for; CompressionError when it cannot be."""


ALGORITHMS: dict[str, type[Algorithm]] = {}


def register(cls: type[Algorithm]) -> type[Algorithm]:
    ALGORITHMS[cls.name] = cls
    return cls


def decode(codec: str, payload: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Decode a payload by its codec's name (the receiver's entry point)."""
    if codec not in ALGORITHMS:
        raise CompressionError(f"unknown codec {codec!r}; expected one of {', '.join(ALGORITHMS)}")
    return ALGORITHMS[codec].decode(payload, tuple(shape), dtype)


@register
class NoCompression(Algorithm):
    """The tensor's own bytes."""

    name = "None"
    lossy = False

    def encode(self, tensor: torch.Tensor, state: dict) -> torch.Tensor:
        return as_bytes(tensor)

    @classmethod
    def decode(cls, payload, shape, dtype):
        numel = math.prod(shape)
        _expect_length(cls.name, payload, numel * torch.empty((), dtype=dtype).element_size(), shape)
        return payload.view(dtype).reshape(shape)


@register
class FP16(Algorithm):
    """Half precision: 2x fewer bytes for float32."""

    name = "FP16"

    def encoded_bytes(self, numel, dtype):
        return 2 * numel

    def encode(self, tensor, state):
        return as_bytes(tensor.to(torch.float16))

    @classmethod
    def decode(cls, payload, shape, dtype):
        _expect_length(cls.name, payload, math.prod(shape) * 2, shape)
        return payload.view(torch.float16).to(dtype).reshape(shape)


@register
class Int8(Algorithm):
    """Symmetric scaled int8: a float32 scale (max |x| / 127), then one byte per element."""

    name = "Int8"

    def encoded_bytes(self, numel, dtype):
        return 4 + numel

    def encode(self, tensor, state):
        flat = tensor.detach().reshape(-1).float()
        scale = flat.abs().max().clamp_min(torch.finfo(torch.float32).tiny) / 127.0
        quantized = torch.round(flat / scale).clamp_(-127, 127).to(torch.int8)
        return torch.cat([as_bytes(scale.reshape(1)), as_bytes(quantized)])

    @classmethod
    def decode(cls, payload, shape, dtype):
        numel = math.prod(shape)
        _expect_length(cls.name, payload, 4 + numel, shape)
        scale = _view(payload, torch.float32, 1)
        values = payload[4:].view(torch.int8).float() * scale
        return values.to(dtype).reshape(shape)


@register
class TopK(Algorithm):
    """The `ratio` largest magnitudes: int32 indices, then their float32 values (8 bytes each)."""

    name = "TopK"
    corrects_momentum = True

    def applies(self, shape, dtype):
        # 8 bytes per kept element against 4 per element: it pays below ratio 0.5.
        return dtype.is_floating_point and self.config.ratio < 0.5

    def encode(self, tensor, state):
        flat = tensor.detach().reshape(-1).float()
        k = max(1, math.ceil(self.config.ratio * flat.numel()))
        indices = flat.abs().topk(k, sorted=False).indices
        return torch.cat([as_bytes(indices.to(torch.int32)), as_bytes(flat[indices])])

    @classmethod
    def decode(cls, payload, shape, dtype):
        numel = math.prod(shape)
        if payload.numel() % 8 or not 0 < payload.numel() // 8 <= numel:
            raise CompressionError(
                f"TopK payload of {payload.numel()} bytes is not 8 bytes (index, value) per kept element "
                f"of a tensor of shape {list(shape)}"
            )
        k = payload.numel() // 8
        indices = _view(payload, torch.int32, k).long()
        if indices.min() < 0 or indices.max() >= numel:
            raise CompressionError(
                f"TopK index out of range [0, {numel}) for shape {list(shape)}: "
                f"min {int(indices.min())}, max {int(indices.max())}"
            )
        out = torch.zeros(numel, dtype=torch.float32)
        out[indices] = _view(payload, torch.float32, k, offset=4 * k)
        return out.to(dtype).reshape(shape)


@register
class PowerSGD(Algorithm):
    """Rank-r approximation P Q^T of the gradient as an m x n matrix (Vogels et al. 2019).

    One power iteration per step, warm-started from the previous step's Q,
    which the worker keeps in the tensor's state: the approximation improves
    across steps at the cost of one iteration. Sends P (m x r) and Q (n x r),
    r(m+n) floats instead of mn.
    """

    name = "PowerSGD"

    @staticmethod
    def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
        return shape[0], math.prod(shape[1:])

    def applies(self, shape, dtype):
        if not dtype.is_floating_point or len(shape) < 2:
            return False
        m, n = self.matrix_shape(shape)
        return self.config.rank * (m + n) < m * n

    def encode(self, tensor, state):
        m, n = self.matrix_shape(tuple(tensor.shape))
        matrix = tensor.detach().reshape(m, n).float()
        q = state.get("q")
        if q is None:
            # Seeded, so every worker starts from the same Q and a run repeats exactly.
            q = torch.randn(n, self.config.rank, generator=torch.Generator().manual_seed(0))
        p = torch.linalg.qr(matrix @ q).Q
        q = matrix.T @ p
        state["q"] = q
        return torch.cat([as_bytes(p), as_bytes(q)])

    @classmethod
    def decode(cls, payload, shape, dtype):
        if len(shape) < 2:
            raise CompressionError(f"PowerSGD needs a tensor of 2 or more dimensions, got shape {list(shape)}")
        m, n = cls.matrix_shape(shape)
        floats, rest = divmod(payload.numel(), 4)
        rank, rest2 = divmod(floats, m + n)
        if rest or rest2 or rank < 1:
            raise CompressionError(
                f"PowerSGD payload of {payload.numel()} bytes is not 4 * r * (m + n) bytes "
                f"for a {m} x {n} matrix (shape {list(shape)})"
            )
        p = _view(payload, torch.float32, m * rank).reshape(m, rank)
        q = _view(payload, torch.float32, n * rank, offset=4 * m * rank).reshape(n, rank)
        return (p @ q.T).to(dtype).reshape(shape)


def compressible(algorithm: Algorithm, tensor: torch.Tensor) -> bool:
    """Whether a tensor travels with the algorithm after warm-up: at least minTensorBytes, and the
    algorithm saves bytes on it (`applies`). Depends on the shape and dtype only, so a shard knows it too."""
    return (
        tensor.numel() * tensor.element_size() >= algorithm.config.min_tensor_bytes
        and algorithm.applies(tuple(tensor.shape), tensor.dtype)
    )


def codec_for(algorithm: Algorithm, tensor: torch.Tensor, step: int) -> str:
    """The codec a tensor travels with at `step`: None during warm-up, below minTensorBytes, or where
    the algorithm saves nothing (`applies`); else the algorithm's. One rule for pushes and pulls."""
    if step < algorithm.config.warmup_steps or not compressible(algorithm, tensor):
        return NoCompression.name
    return algorithm.name


def momentum_corrected(compression: Compression, optimizer: Optimizer, tensor: torch.Tensor) -> bool:
    """Whether the worker keeps this tensor's momentum and the shard applies its pushes without it.

    The one rule both sides follow (the worker's GradientCompressor, the shard's optimizer in
    kubetrain/trainer/ps/job.py): SGD with momentum, an algorithm that `corrects_momentum`, and a tensor it
    compresses. From the first step, warm-up included, so the update rule never changes mid-run."""
    algorithm = ALGORITHMS[compression.algorithm]
    return (
        optimizer.name == "sgd"
        and optimizer.momentum > 0
        and algorithm.corrects_momentum
        and compressible(algorithm(compression), tensor)
    )


@register
class Ternary(Algorithm):
    """Each element as -s, 0 or +s, s the largest magnitude of its block of BLOCK elements.

    Layout: one bfloat16 scale per block (bfloat16: float32's range, so a
    tiny change does not underflow to a zero scale), then the elements, five
    to a byte (3^5 = 243 <= 256): 1.6 + 16 / BLOCK bits an element, 17x fewer
    bytes than float32. Rounding is stochastic (unbiased: +s with probability
    x / s), from a generator seeded per tensor, so a run repeats exactly.

    Not an algorithm a job names: the codec of compressed pulls for TopK and
    PowerSGD (PullCompressor, PULL_CODECS) where the change of the parameters
    since a pull is dense: the shard's momentum spreads every sparse or
    low-rank gradient over the steps after it (a sparse change goes as
    Sparse). TopK of that change left the worker's copy far behind
    (quickstart accuracy 0.805 against 0.958), one scale per tensor too
    (0.919: a few large changes set the scale and most elements round to 0
    until they catch up); a scale per block of 64 follows the local size.
    """

    name = "Ternary"
    # Elements per scale: a bfloat16 scale costs 16 / BLOCK bits an element.
    # On the quickstart (TopK 1% pushes) 64 gave accuracy 0.961 at 20.9x fewer
    # bytes in all, 128 gave 0.955 at 21.8x, one scale per tensor 0.919 at 22.6x.
    BLOCK = 64
    PER_BYTE = 5
    _POWERS = torch.tensor([1, 3, 9, 27, 81], dtype=torch.int32)
    # Byte value -> its five elements in {-1, 0, 1}: decoding is one table lookup.
    _TABLE = ((torch.arange(243, dtype=torch.int32)[:, None] // _POWERS) % 3 - 1).to(torch.int8)

    def applies(self, shape, dtype):
        return dtype.is_floating_point

    @classmethod
    def sizes(cls, numel: int) -> tuple[int, int]:
        """(blocks, packed bytes) of a tensor of numel elements."""
        return -(-numel // cls.BLOCK), -(-numel // cls.PER_BYTE)

    def encoded_bytes(self, numel, dtype):
        blocks, packed = self.sizes(numel)
        return 2 * blocks + packed

    def encode(self, tensor, state):
        flat = tensor.detach().reshape(-1).float()
        numel = flat.numel()
        blocks, _ = self.sizes(numel)
        padded = torch.cat([flat, flat.new_zeros(blocks * self.BLOCK - numel)]).reshape(blocks, self.BLOCK)
        scales = padded.abs().amax(1).to(torch.bfloat16)
        used = scales.float()
        divisor = torch.where(used > 0, used, torch.ones_like(used))[:, None]  # a zero block stays 0
        ratio = (padded / divisor).reshape(-1)[:numel]
        generator = state.setdefault("generator", torch.Generator().manual_seed(0))
        trits = (torch.floor(ratio + torch.rand(numel, generator=generator)).clamp_(-1, 1) + 1).to(torch.int32)
        trits = torch.cat([trits, torch.ones(-numel % self.PER_BYTE, dtype=torch.int32)]).reshape(-1, self.PER_BYTE)
        packed = (trits * self._POWERS).sum(1).to(torch.uint8)
        return torch.cat([as_bytes(scales), packed])

    @classmethod
    def decode(cls, payload, shape, dtype):
        numel = math.prod(shape)
        blocks, packed_bytes = cls.sizes(numel)
        _expect_length(cls.name, payload, 2 * blocks + packed_bytes, shape)
        packed = payload[2 * blocks:].long()
        if numel and int(packed.max()) >= 243:
            raise CompressionError(f"Ternary byte {int(packed.max())} is not five base-3 digits (at most 242)")
        scales = _view(payload, torch.bfloat16, blocks).float().repeat_interleave(cls.BLOCK)[:numel]
        values = cls._TABLE[packed].reshape(-1)[:numel].float() * scales
        return values.to(dtype).reshape(shape)


@register
class Sparse(Algorithm):
    """Exactly the elements that are not zero: their values, then their indices, ascending.

    Layout: the k values in the tensor's own dtype, bit for bit, then their k
    indices (little-endian: 2 bytes each for a tensor of at most 65,536
    elements, else 4). Lossless. Not an algorithm a job names: the codec of a
    compressed pull whose change is sparse (PullCompressor), as a TopK job's
    is under momentum correction: the shard applies plain SGD to what
    arrives, so a step changes at most workers x ratio of each tensor, and
    those elements travel exact in 6 bytes each (float32) where Ternary
    spends 1.85 bits on every element of the tensor.
    """

    name = "Sparse"
    lossy = False

    @staticmethod
    def index_bytes(numel: int) -> int:
        return 2 if numel <= 1 << 16 else 4

    @classmethod
    def payload_bytes(cls, numel: int, nonzero: int, dtype: torch.dtype) -> int:
        return nonzero * (cls.index_bytes(numel) + torch.empty((), dtype=dtype).element_size())

    def encode(self, tensor, state):
        flat = tensor.detach().reshape(-1)
        indices = flat.nonzero().reshape(-1)  # ascending
        width = self.index_bytes(flat.numel())
        index_payload = as_bytes(indices.to(torch.int32)).reshape(-1, 4)[:, :width].reshape(-1)  # little-endian
        return torch.cat([as_bytes(flat[indices]), index_payload])

    @classmethod
    def decode(cls, payload, shape, dtype):
        numel = math.prod(shape)
        width, element = cls.index_bytes(numel), torch.empty((), dtype=dtype).element_size()
        k, rest = divmod(payload.numel(), width + element)
        # A sender uses it only where it is smaller than the tensor: anything larger is hostile.
        if rest or payload.numel() > numel * element:
            raise CompressionError(
                f"Sparse payload of {payload.numel()} bytes is not {width + element} bytes (index, value) per "
                f"element of a tensor of shape {list(shape)}, at most {numel * element} bytes in all"
            )
        # Read byte by byte: after values of 2 bytes the indices need not be 4-aligned for a view.
        indices = (payload[k * element:].reshape(k, width).long() << torch.arange(0, 8 * width, 8)).sum(1)
        if k and (indices.min() < 0 or indices.max() >= numel):
            raise CompressionError(f"Sparse index out of range [0, {numel}) for shape {list(shape)}")
        if k > 1 and not bool((indices[1:] > indices[:-1]).all()):
            raise CompressionError("Sparse indices must ascend, each once")
        out = torch.zeros(numel, dtype=dtype)
        out[indices] = _view(payload, dtype, k)
        return out.reshape(shape)


class GradientCompressor:
    """A worker's compression of its named gradients, with error feedback and byte counts.

    Given the job's optimizer (and, with weight decay, the worker's parameters), it applies momentum
    correction to the tensors `momentum_corrected` names: it adds the weight decay, accumulates the
    velocity, sends the velocity through error feedback, and zeroes velocity and residual where a
    coordinate was sent (momentum factor masking). Without an optimizer it compresses gradients as they are.
    """

    def __init__(self, config: Compression, optimizer: Optimizer | None = None,
                 params: Mapping[str, torch.Tensor] | None = None):
        if config.algorithm not in ALGORITHMS:
            raise ValueError(f"spec.parameterServer.compression.algorithm: unknown {config.algorithm!r}")
        if optimizer is not None and optimizer.weight_decay and params is None:
            raise ValueError("GradientCompressor: weight decay moves to the worker with momentum correction; "
                             "pass the worker's parameters")
        self.config = config
        self.algorithm = ALGORITHMS[config.algorithm](config)
        self.optimizer = optimizer
        self.params = params
        self.residuals: dict[str, torch.Tensor] = {}
        self.velocities: dict[str, torch.Tensor] = {}
        """Momentum correction: each corrected tensor's velocity u (the shard's momentum buffer, moved here)."""
        self.states: dict[str, dict] = {}
        self.raw_bytes = 0
        self.compressed_bytes = 0

    def codec_for(self, grad: torch.Tensor, step: int) -> str:
        return codec_for(self.algorithm, grad, step)

    def corrected(self, grad: torch.Tensor) -> bool:
        return self.optimizer is not None and momentum_corrected(self.config, self.optimizer, grad)

    def compress(self, name: str, grad: torch.Tensor, step: int) -> Encoded:
        """Encode one gradient for `step` (0-based, the worker's own count)."""
        self.raw_bytes += grad.numel() * grad.element_size()
        codec = self.codec_for(grad, step)
        if self.corrected(grad):
            payload = self._corrected(name, grad, codec)
        elif codec == NoCompression.name:
            payload = as_bytes(grad)
        else:
            corrected = grad.detach() + self.residuals[name] if name in self.residuals else grad.detach().clone()
            payload = self.algorithm.encode(corrected, self.states.setdefault(name, {}))
            if self.algorithm.lossy:
                sent = self.algorithm.decode(payload, tuple(grad.shape), grad.dtype)
                self.residuals[name] = corrected - sent
        self.compressed_bytes += payload.numel()
        return Encoded(codec, payload)

    def _corrected(self, name: str, grad: torch.Tensor, codec: str) -> torch.Tensor:
        """Momentum correction and factor masking (module docstring): the payload of v = residual + u."""
        assert self.optimizer is not None
        grad = grad.detach()
        if self.optimizer.weight_decay:
            assert self.params is not None
            # As torch.optim.SGD does, inside the momentum: the shard's group for this tensor has none.
            grad = grad + self.optimizer.weight_decay * self.params[name].detach()
        velocity = self.velocities.get(name)
        velocity = grad.clone() if velocity is None else velocity.mul_(self.optimizer.momentum).add_(grad)
        self.velocities[name] = velocity
        accumulated = velocity + self.residuals[name] if name in self.residuals else velocity.clone()
        if codec == NoCompression.name:
            # Warm-up: everything goes, and the velocity is kept (masking it all would be SGD without momentum).
            self.residuals.pop(name, None)
            return as_bytes(accumulated)
        payload = self.algorithm.encode(accumulated, self.states.setdefault(name, {}))
        sent = self.algorithm.decode(payload, tuple(grad.shape), grad.dtype)
        self.residuals[name] = accumulated - sent  # exactly 0 where sent: TopK sends the values themselves
        # Momentum factor masking: a sent coordinate's velocity starts again from its next gradient.
        # Momentum SGD would go on applying the momentum of the gradients just sent, but they waited
        # here tens of steps and their direction is stale: on the quickstart (TopK 1%, seeds 0 to 7)
        # correction without masking averaged 4.3 points under None, worse than no correction (2.6),
        # with masking 1.0. A coordinate sent as exactly 0 counts as not sent (its velocity is ~0).
        velocity.masked_fill_(sent != 0, 0.0)
        return payload

    @property
    def ratio(self) -> float:
        """Raw over compressed bytes so far (1.0 before any gradient)."""
        return self.raw_bytes / self.compressed_bytes if self.compressed_bytes else 1.0


# --- compressed pulls: a shard's copies of what each worker holds ---------------------------

# Bytes of workers' copies one shard keeps for compressed pulls. A copy is one
# copy of the shard's parameters per worker (in float32, 4 bytes a parameter),
# on top of what the shard already holds (parameters, the copy pulls are served
# from, optimizer state, a push buffer per worker). 4 GiB is what a shard pod
# can hold beside that without a special memory request: 32 workers of a 128
# MiB shard, 2 of a 2 GiB one. Workers past the budget get no copy: every pull
# of theirs is whole, exact and uncompressed (correct, only larger); the
# workers that got one first keep it (no eviction, so no worker's copies
# thrash against another's).
MAX_WORKER_COPY_BYTES = 4 << 30


def copy_crc32(tensors: Iterable[torch.Tensor]) -> int:
    """CRC-32 of the tensors' bytes in the order given: a worker and its shard compare their copies by it."""
    crc = 0
    for tensor in tensors:
        crc = zlib.crc32(as_bytes(tensor.detach().cpu()).numpy(), crc)  # type: ignore[arg-type]  # an ndarray is a buffer
    return crc


@dataclass
class WorkerCopy:
    """What one worker holds of a shard's parameters, bit for bit, as the shard last sent it."""

    copy: int
    """Names this copy (PullHeader.copy); random, so no other shard incarnation's copy has it."""
    tensors: dict[str, torch.Tensor]
    states: dict[str, dict]
    """Codec state per tensor (PowerSGD's Q), this worker's own."""


@dataclass
class EncodedPull:
    """One pull reply of a shard to one worker: the copy it names, its CRC, and a payload per tensor."""

    copy: int
    crc32: int
    tensors: dict[str, Encoded]
    whole: bool
    """Every tensor travels as its value (codec None): a first pull, a warm-up, a final or a fallback pull."""


PULL_CODECS = {"TopK": Ternary.name, "PowerSGD": Ternary.name}
"""The codec of a pull where it is not the job's own (Ternary's docstring says why)."""


class PullCompressor:
    """A shard's compressed pulls: per worker, the copy of the parameters it holds, and the change since.

    A worker that names the copy the shard last sent it gets, per tensor,
    the change since that copy (published - copy) encoded with the job's
    algorithm, and the shard adds exactly what the worker will decode to its
    record of the copy. What the codec dropped stays in published - copy and
    goes out with a later pull: error feedback, kept as the copy itself
    rather than as a separate residual. Tensors the algorithm does not apply
    to (minTensorBytes, 1-D for PowerSGD, warm-up) travel as their value, as
    does everything in a whole pull (`EncodedPull.whole`).

    Not thread-safe per worker: the shard serialises one worker's pulls.
    """

    def __init__(self, config: Compression, shard_bytes: int, budget_bytes: int = MAX_WORKER_COPY_BYTES):
        if config.algorithm not in ALGORITHMS:
            raise ValueError(f"spec.parameterServer.compression.algorithm: unknown {config.algorithm!r}")
        self.config = config
        self.algorithm = ALGORITHMS[PULL_CODECS.get(config.algorithm, config.algorithm)](config)
        self.sparse = Sparse(config)
        self.slots = budget_bytes // max(shard_bytes, 1)
        """How many workers' copies fit the budget."""
        self.copies: dict[int, WorkerCopy] = {}
        self._admit = threading.Lock()
        self.whole_pulls = 0
        self.compressed_pulls = 0
        self.sparse_pull_tensors = 0
        """Tensors of compressed pulls whose change went exact, as Sparse."""

    @property
    def enabled(self) -> bool:
        """Pulls carry changes only with a lossy algorithm; with None every pull is the parameters whole."""
        return self.algorithm.lossy

    def encode(self, worker: int, have: int, params: dict[str, torch.Tensor], worker_step: int,
               final: bool = False) -> EncodedPull:
        """The reply to `worker`, who holds copy `have` (0: none), of the parameters `params`.

        Whole when the worker holds no copy this shard knows (a first pull, a
        restarted worker, a restarted shard, a retry after a reply that did
        not arrive whole), during warm-up, for the final pull (evaluation and
        export need the exact parameters; the copy is then dropped), and
        for a worker past the budget (no copy kept: `copy` 0).
        """
        held = self.copies.get(worker)
        if held is not None and held.copy != have:
            held = None  # the worker does not hold what this shard last sent it
        whole = held is None or final or worker_step < self.config.warmup_steps
        if final:
            self.copies.pop(worker, None)
            return self._whole(params, copy=0)
        if held is None:
            with self._admit:
                admitted = worker in self.copies or len(self.copies) < self.slots
                if not admitted:
                    return self._whole(params, copy=0)
                held = WorkerCopy(0, {n: t.detach().clone() for n, t in params.items()}, {})
                self.copies[worker] = held
        out: dict[str, Encoded] = {}
        for name, value in params.items():
            mine = held.tensors[name]
            codec = NoCompression.name if whole else codec_for(self.algorithm, value, worker_step)
            if codec == NoCompression.name:
                mine.copy_(value)
                out[name] = Encoded(codec, as_bytes(value))
                continue
            change = value - mine
            algorithm = self._codec_of(change)
            self.sparse_pull_tensors += algorithm is self.sparse
            payload = algorithm.encode(change, held.states.setdefault(name, {}))
            # Exactly what the worker will add: the same decode of the same bytes.
            mine.add_(algorithm.decode(payload, tuple(value.shape), value.dtype))
            out[name] = Encoded(algorithm.name, payload)
        held.copy = random.getrandbits(63) or 1
        if whole:
            self.whole_pulls += 1
        else:
            self.compressed_pulls += 1
        return EncodedPull(held.copy, copy_crc32(held.tensors[n] for n in sorted(held.tensors)), out, whole)

    def _codec_of(self, change: torch.Tensor) -> Algorithm:
        """Sparse (exact) where few elements changed and that is smaller than the pull's codec, else that codec.

        A TopK job under momentum correction changes at most workers x ratio
        of a tensor per step: its pulls go exact, in fewer bytes than Ternary.
        """
        dense = self.algorithm.encoded_bytes(change.numel(), change.dtype)
        if dense is None:
            return self.algorithm
        sparse = Sparse.payload_bytes(change.numel(), int(change.count_nonzero()), change.dtype)
        return self.sparse if sparse < dense else self.algorithm

    def _whole(self, params: dict[str, torch.Tensor], copy: int) -> EncodedPull:
        self.whole_pulls += 1
        tensors = {n: Encoded(NoCompression.name, as_bytes(t)) for n, t in params.items()}
        return EncodedPull(copy, 0, tensors, True)

    def forget(self, worker: int) -> None:
        self.copies.pop(worker, None)
