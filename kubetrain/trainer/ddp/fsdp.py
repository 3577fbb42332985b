"""FSDP2 for the built-in DDP loop (`spec.ddp.strategy: FSDP`): the model sharded across the group's ranks.

Every module that owns parameters of its own (the built-in models' Linear
and Conv layers) is wrapped with `fully_shard`, then the root, so each rank
holds 1/world of every parameter and of the optimizer's state; forward and
backward gather a layer's parameters while it runs and reduce-scatter its
gradients. The state goes to checkpoints as DTensors, through the sharded path
(kubetrain/trainer/sharded.py): every rank writes its own shards, and a restart of any
size loads them resharded.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def shard(model: nn.Module, device: torch.device, world_size: int) -> Any:
    """Shard `model` in place over a 1-D mesh of every rank; returns the mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world_size,))
    for module in blocks(model):
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return mesh


def blocks(model: nn.Module) -> list[nn.Module]:
    """The modules that own parameters directly (not through a child), children before parents, root excluded;
    or the units a model names itself (`shard_units`: a causal-lm's decoder layers).

    For the built-in models these are their layers; a layer is the unit FSDP
    gathers at once, so the whole model is never gathered on one rank.
    """
    units = getattr(model, "shard_units", None)
    if units is not None:
        return list(units())
    return [m for name, m in model.named_modules()
            if name and any(True for _ in m.parameters(recurse=False))]


def model_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model, optimizer) state dicts of a sharded model, DTensors keyed by parameter name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=_adapters_only(model)))


def _adapters_only(model: nn.Module) -> bool:
    """A LoRA job: checkpoints hold the trainable adapters, not the frozen pretrained weights."""
    return getattr(model, "lora", None) is not None


def load_model_state(model: nn.Module, optimizer: torch.optim.Optimizer, model_sd: dict[str, Any],
                     optim_sd: dict[str, Any]) -> None:
    """Give a restored template's model and optimizer state back to the model and the optimizer."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    frozen = _adapters_only(model)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                   options=StateDictOptions(ignore_frozen_params=frozen, strict=not frozen))


def to_local(tree: Any) -> Any:
    """`tree` (a state dict, nested) with every DTensor replaced by this rank's local shard: what a healing
    peer's rank of the same place receives (a DTensor's device mesh means nothing in another process)."""
    from torch.distributed.tensor import DTensor

    if isinstance(tree, DTensor):
        return tree.to_local()
    if isinstance(tree, dict):
        return {k: to_local(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [to_local(v) for v in tree]
    return tree


def from_local(model: nn.Module, model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> tuple[dict, dict]:
    """The (model, optimizer) state dicts of `to_local` as DTensors again, sharded as this rank's own
    parameters (keyed by parameter name): a shard of a parameter, or of its optimizer state of the same shape."""
    from torch.distributed.tensor import DTensor

    params = dict(model.named_parameters())

    def rebuild(name: str, value: Any) -> Any:
        param = params.get(name)
        if (not isinstance(param, DTensor) or not isinstance(value, torch.Tensor) or isinstance(value, DTensor)
                or value.dim() == 0 or value.shape != param.to_local().shape):
            return value
        return DTensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())

    model_out = {name: rebuild(name, value) for name, value in model_sd.items()}
    optim_out = dict(optim_sd)
    optim_out["state"] = {name: {k: rebuild(name, v) for k, v in entry.items()}
                          for name, entry in (optim_sd.get("state") or {}).items()}
    return model_out, optim_out
