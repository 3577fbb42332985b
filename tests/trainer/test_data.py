"""Datasets load into tensors, bad inputs name their field, and shards are disjoint and resumable."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from kubetrain.api.spec import Dataset
from kubetrain.trainer.data import ShardCursor, load_data
from kubetrain.trainer.errors import ConfigError, LoadError


@dataclass
class ShardCase:
    name: str
    num_samples: int
    world_size: int
    batch_size: int


SHARD_CASES = [
    ShardCase("one rank", 100, 1, 16),
    ShardCase("divisible", 120, 4, 7),
    ShardCase("remainder", 103, 4, 8),
    ShardCase("batch larger than shard", 50, 5, 64),
]


def epoch_of(cursor: ShardCursor) -> list[int]:
    indices = [cursor.next_batch() for _ in range(cursor.steps_per_epoch)]
    return torch.cat(indices).tolist()


@pytest.mark.parametrize("case", SHARD_CASES, ids=lambda c: c.name)
def test_shards_are_disjoint_equal_and_cover_all_but_the_remainder(case: ShardCase) -> None:
    world = range(case.world_size)
    cursors = [ShardCursor(case.num_samples, r, case.world_size, case.batch_size, seed=3) for r in world]
    for epoch in range(2):
        shards = [epoch_of(c) for c in cursors]
        seen = [i for shard in shards for i in shard]
        assert len(seen) == len(set(seen)), "a sample is in two shards"
        assert len(seen) == case.num_samples - case.num_samples % case.world_size
        assert {len(s) for s in shards} == {case.num_samples // case.world_size}
        assert all(c.epoch == epoch + 1 and c.position == 0 for c in cursors)


def test_epochs_reshuffle_and_the_order_depends_only_on_the_seed() -> None:
    first, again, other_seed = (ShardCursor(64, 0, 1, 8, seed) for seed in (1, 1, 2))
    epoch0 = epoch_of(first)
    assert epoch_of(first) != epoch0
    assert epoch_of(again) == epoch0
    assert epoch_of(other_seed) != epoch0


@pytest.mark.parametrize("stop_after", [0, 1, 4, 5, 7], ids=lambda n: f"after {n} batches")
def test_resumed_cursor_neither_repeats_nor_skips(stop_after: int) -> None:
    # 40 samples, batches of 8 -> 5 steps an epoch; stopping after 5 or 7 crosses an epoch.
    straight = ShardCursor(40, 1, 2, 8, seed=0)
    expected = [straight.next_batch().tolist() for _ in range(10)]
    before = ShardCursor(40, 1, 2, 8, seed=0)
    got = [before.next_batch().tolist() for _ in range(stop_after)]
    after = ShardCursor(40, 1, 2, 8, seed=0)
    after.load_state_dict(before.state_dict())
    got += [after.next_batch().tolist() for _ in range(10 - stop_after)]
    assert got == expected


def test_cursor_state_of_another_shard_is_refused() -> None:
    state = ShardCursor(40, 0, 2, 8, seed=0).state_dict()
    with pytest.raises(ConfigError, match="rank=0, this cursor has rank=1"):
        ShardCursor(40, 1, 2, 8, seed=0).load_state_dict(state)


def test_more_ranks_than_samples_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="3 training samples cannot be sharded over 4 ranks"):
        ShardCursor(3, 0, 4, 1, seed=0)


def test_digits_load_scaled_and_split_by_eval_fraction() -> None:
    data = load_data(Dataset(name="digits", eval_fraction=0.2), seed=0)
    assert data.input_shape == (64,) and data.num_classes == 10
    assert len(data.train_x) + len(data.eval_x) == 1797 and len(data.eval_x) == 359
    assert data.train_x.dtype == torch.float32 and data.train_y.dtype == torch.int64
    assert 0.0 <= float(data.train_x.min()) and float(data.train_x.max()) <= 1.0


def test_synthetic_takes_its_args_and_defaults_its_seed_to_the_training_seed() -> None:
    spec = Dataset(name="synthetic", args={"samples": 100, "features": 5, "classes": 3}, eval_fraction=0.1)
    data = load_data(spec, seed=7)
    assert data.input_shape == (5,) and data.num_classes == 3 and len(data.train_x) == 90
    # The split follows the training seed (0 here); the samples themselves follow args.seed.
    same = load_data(Dataset(name="synthetic", args={**spec.args, "seed": 7}, eval_fraction=0.1), seed=0)
    other = load_data(Dataset(name="synthetic", args={**spec.args, "seed": 8}, eval_fraction=0.1), seed=0)

    def all_values(d):
        return torch.sort(torch.cat([d.train_x, d.eval_x]).flatten()).values

    assert torch.equal(all_values(data), all_values(same))
    assert not torch.equal(all_values(data), all_values(other))


def test_npz_file_loads(tmp_path: Path) -> None:
    path = tmp_path / "d.npz"
    np.savez(path, x=np.arange(40, dtype=np.float64).reshape(10, 2, 2), y=np.arange(10) % 2)
    data = load_data(Dataset(path=str(path), eval_fraction=0.2), seed=0)
    assert data.input_shape == (2, 2) and data.num_classes == 2 and len(data.eval_x) == 2


def test_entrypoint_dataset_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "userdata.py").write_text(
        "import numpy as np\n"
        "def make(n=10):\n"
        "    return np.ones((n, 3)), np.arange(n) % 2\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    data = load_data(Dataset(entrypoint="userdata:make", args={"n": 20}, eval_fraction=0.5), seed=0)
    assert len(data.train_x) == 10 and data.input_shape == (3,)
    sys.modules.pop("userdata", None)


def test_regression_targets_load_as_float32_one_target_per_sample(tmp_path: Path) -> None:
    path = tmp_path / "r.npz"
    x = np.arange(40, dtype=np.float32).reshape(10, 4)
    np.savez(path, x=x, y=x[:, 0] * 2.5)
    data = load_data(Dataset(path=str(path), eval_fraction=0.2), seed=0, loss="mse")
    assert data.num_classes is None and data.target_shape == (1,)  # a 1-D y is one value per sample
    assert data.train_y.dtype == torch.float32 and data.train_y.shape == (8, 1)
    assert torch.equal(data.train_y[:, 0], data.train_x[:, 0] * 2.5)  # the split keeps x and y together
    np.savez(path, x=x, y=np.ones((10, 2, 3)))
    assert load_data(Dataset(path=str(path)), seed=0, loss="l1").target_shape == (2, 3)


@dataclass
class BadInput:
    name: str
    spec: dict
    error: type[Exception]
    message: str


BAD_INPUTS = [
    BadInput("missing npz", {"path": "{tmp}/none.npz"}, LoadError, "spec.dataset.path: {tmp}/none.npz: no such file"),
    BadInput("npz without y", {"path": "{tmp}/no_y.npz"}, LoadError, "has no array 'y' (found x)"),
    BadInput("not an npz", {"path": "{tmp}/text.npz"}, LoadError, "not a zip file (an .npz is one)"),
    BadInput("entrypoint module missing", {"entrypoint": "nosuchmodule:make"}, LoadError,
             "spec.dataset.entrypoint: nosuchmodule:make: cannot import 'nosuchmodule'"),
    BadInput("entrypoint not callable", {"entrypoint": "math:pi"}, LoadError, "'pi' is a float, not callable"),
    BadInput("entrypoint attribute missing", {"entrypoint": "math:nothing"}, LoadError, "has no attribute 'nothing'"),
    BadInput("unknown name", {"name": "imagenet"}, LoadError, "spec.dataset.name: unknown dataset 'imagenet'"),
    BadInput("float labels for crossEntropy", {"path": "{tmp}/floats.npz"}, LoadError,
             "spec.dataset.path: {tmp}/floats.npz: y holds float64 values, but spec.training.loss crossEntropy "
             "needs integer class labels"),
    BadInput("unknown argument", {"name": "synthetic", "args": {"colour": 1}}, ConfigError,
             "spec.dataset.args: synthetic does not take these arguments"),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=lambda c: c.name)
def test_bad_dataset_input_names_the_field(case: BadInput, tmp_path: Path) -> None:
    np.savez(tmp_path / "no_y.npz", x=np.zeros((4, 2)))
    (tmp_path / "text.npz").write_text("not a zip")
    np.savez(tmp_path / "floats.npz", x=np.zeros((4, 2)), y=np.linspace(0, 1, 4))
    fields = {k: v.replace("{tmp}", str(tmp_path)) if isinstance(v, str) else v for k, v in case.spec.items()}
    with pytest.raises(case.error) as err:
        load_data(Dataset(**fields), seed=0)
    assert case.message.replace("{tmp}", str(tmp_path)) in str(err.value)
    assert "\n" not in str(err.value)
