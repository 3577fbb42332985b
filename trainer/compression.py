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
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from kubetrain_operator.api.spec import Compression


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

    def __init__(self, config: Compression):
        self.config = config

    def applies(self, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
        """Whether encoding a tensor of this shape saves bytes; otherwise it travels as None."""
        return dtype.is_floating_point

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


class GradientCompressor:
    """A worker's compression of its named gradients, with error feedback and byte counts."""

    def __init__(self, config: Compression):
        if config.algorithm not in ALGORITHMS:
            raise ValueError(f"spec.parameterServer.compression.algorithm: unknown {config.algorithm!r}")
        self.config = config
        self.algorithm = ALGORITHMS[config.algorithm](config)
        self.residuals: dict[str, torch.Tensor] = {}
        self.states: dict[str, dict] = {}
        self.raw_bytes = 0
        self.compressed_bytes = 0

    def codec_for(self, grad: torch.Tensor, step: int) -> str:
        if (
            step < self.config.warmup_steps
            or grad.numel() * grad.element_size() < self.config.min_tensor_bytes
            or not self.algorithm.applies(tuple(grad.shape), grad.dtype)
        ):
            return NoCompression.name
        return self.algorithm.name

    def compress(self, name: str, grad: torch.Tensor, step: int) -> Encoded:
        """Encode one gradient for `step` (0-based, the worker's own count)."""
        self.raw_bytes += grad.numel() * grad.element_size()
        codec = self.codec_for(grad, step)
        if codec == NoCompression.name:
            payload = as_bytes(grad)
        else:
            corrected = grad.detach() + self.residuals[name] if name in self.residuals else grad.detach().clone()
            payload = self.algorithm.encode(corrected, self.states.setdefault(name, {}))
            if self.algorithm.lossy:
                sent = self.algorithm.decode(payload, tuple(grad.shape), grad.dtype)
                self.residuals[name] = corrected - sent
        self.compressed_bytes += payload.numel()
        return Encoded(codec, payload)

    @property
    def ratio(self) -> float:
        """Raw over compressed bytes so far (1.0 before any gradient)."""
        return self.raw_bytes / self.compressed_bytes if self.compressed_bytes else 1.0
