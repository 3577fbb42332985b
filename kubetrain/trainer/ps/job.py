"""What the parameter servers and the workers derive alike from the job: model, shards, settings.

Both sides build the model from the same seed and assign its parameters to
shards with the same pure function, so neither the initial parameters nor
the assignment ever travel over the wire.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from kubetrain.api.spec import Compression, Optimizer, ParameterServer
from torch import nn

from ..context import ReplicaContext
from .. import models
from ..compression import momentum_corrected
from ..data import Data
from ..errors import ConfigError
from .sharding import assign_shards
from .transport import DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES

CHUNK_ENV = "KUBETRAIN_PS_CHUNK_BYTES"


def ps_spec(ctx: ReplicaContext) -> ParameterServer:
    spec = ctx.spec
    if spec.mode != "ParameterServer" or spec.parameter_server is None:
        raise ConfigError(f"spec.mode: the {ctx.role} role needs mode ParameterServer, got {spec.mode}")
    if not ctx.token:
        raise ConfigError("KUBETRAIN_JOB_TOKEN: empty; parameter servers refuse to serve without a job token")
    return spec.parameter_server


def chunk_bytes(environ: Mapping[str, str] = os.environ) -> int:
    """Chunk size of tensor streams: KUBETRAIN_PS_CHUNK_BYTES, 1 MiB by default, at most 4 MiB."""
    raw = environ.get(CHUNK_ENV, "")
    try:
        value = int(raw) if raw else DEFAULT_CHUNK_BYTES
    except ValueError:
        raise ConfigError(f"{CHUNK_ENV}: expected a number of bytes, got {raw!r}") from None
    if not 0 < value <= MAX_CHUNK_BYTES:
        raise ConfigError(f"{CHUNK_ENV}: must be between 1 and {MAX_CHUNK_BYTES}, got {value}")
    return value


def model_and_data(ctx: ReplicaContext) -> tuple[nn.Module, Data]:
    """The job's model and data (models.model_and_data). Shards load the data too: the
    model's output width comes from it (the classes, or the target shape), and a bad
    loss or dataset fails every replica alike, at start."""
    return models.model_and_data(ctx.spec)


def shards_of(model: nn.Module, shards: int) -> list[list[str]]:
    """Parameter names of each shard, balanced by bytes."""
    sizes = {name: p.numel() * p.element_size() for name, p in model.named_parameters()}
    return assign_shards(sizes, shards)


def shard_optimizer(params: list[nn.Parameter], optimizer: Optimizer, compression: Compression) -> torch.optim.Optimizer:
    """The shard's optimizer: the job's, except for the tensors whose workers keep the momentum.

    Those (compression.momentum_corrected: TopK under SGD with momentum) arrive as velocities with
    the weight decay inside them, so the shard applies them with plain SGD, momentum and weight decay
    0, in a parameter group of their own: momentum applied again would count each gradient 1/(1-m)^2
    times (100 at m 0.9) instead of 1/(1-m) (10). Every other
    tensor, and every job without such tensors, gets the job's optimizer unchanged (one group).
    """
    corrected = [momentum_corrected(compression, optimizer, p) for p in params]
    if not any(corrected):
        return models.build_optimizer(params, optimizer)
    plain = {"momentum": 0.0, "weight_decay": 0.0}
    groups: list[dict[str, Any]] = [{"params": [p for p, c in zip(params, corrected) if not c]},
              {"params": [p for p, c in zip(params, corrected) if c], **plain}]
    built = models.build_optimizer([g for g in groups if g["params"]], optimizer)
    # torch restores a group's settings from the checkpoint: one written before momentum correction
    # (a single group, the job's momentum) would put the momentum back on top of the workers'.
    built.register_load_state_dict_post_hook(lambda opt: opt.param_groups[-1].update(plain))
    return built
