"""`kubetrain bench checkpoint`: one short real run prints its figures; bad arguments are named."""

from __future__ import annotations

import json

import pytest

from kubetrain.bench.sharded import SECONDS_DECIMALS
from kubetrain.cli import main


def test_bench_checkpoint_measures_sync_and_background_saves_in_one_run(tmp_path, capsys):
    out = tmp_path / "checkpoint.json"
    code = main(["bench", "checkpoint", "--steps", "2", "--every", "1", "--rounds", "1", "--dir", str(tmp_path),
                 "--out", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["parameter_bytes"] >= 100 * 10**6 and result["state_bytes"] == 2 * result["parameter_bytes"]
    assert result["file_bytes"] > result["state_bytes"]
    assert result["checkpoints_in_background"] == 2
    # The ratio is of the unrounded seconds; the printed seconds are rounded to 4 decimals (0.3507 against 0.3508 seen).
    assert result["ratio_stall_to_sync"] == pytest.approx(result["stall_seconds"] / result["sync_write_seconds"],
                                                          rel=0.01, abs=1e-4)
    assert set(result["step_seconds"]) == {"none", "checkpoints"}
    assert result["restore_seconds"] > 0 and result["ratio_restore_to_sync"] == pytest.approx(
        result["restore_seconds"] / result["sync_write_seconds"], rel=0.01, abs=1e-4)
    assert list(tmp_path.iterdir()) == [out], "the checkpoints go into a temporary directory that is removed"


@pytest.mark.parametrize("args, words", [
    (["--model-mb", "10"], "--model-mb must be at least 100"),
    (["--every", "0"], "--every and --rounds at least 1"),
    (["--dir", "/nonexistent/place"], "--dir /nonexistent/place: not a directory"),
])
def test_bench_checkpoint_names_a_bad_argument(capsys, args, words):
    assert main(["bench", "checkpoint", *args]) == 2
    assert words in capsys.readouterr().err


def test_bench_checkpoint_sharded_measures_every_ratio_in_one_run(tmp_path):
    out = tmp_path / "sharded.json"
    code = main(["bench", "checkpoint", "--sharded", "--gib", "0.1", "--dir", str(tmp_path), "--out", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    # One 4096 x 4096 layer with AdamW's two moments: 192 MiB, each of the 2 ranks holding half.
    assert result["state_gib"] == 0.188 and result["shard_gib_per_rank"] == 0.094
    seconds = result["seconds"]
    assert set(seconds) == {"first_blocking", "first_wait", "blocking", "wait", "sync", "restore", "plain"}
    # The ratios are of the unrounded seconds: each printed second is off by half its last decimal at most, and
    # a blocking save of this size takes about 0.01 s (0.0492 against 0.0502 from 3-decimal seconds was seen).
    half = 0.5 * 10.0 ** -SECONDS_DECIMALS

    # The two errors add up: the seconds' rounding (relative) and the ratio's own to 4 decimals (absolute).
    # pytest.approx takes the larger of rel and abs, not their sum, so the sum is given as abs.
    save = seconds["blocking"] + seconds["wait"]
    blocking_ratio = seconds["blocking"] / seconds["sync"]
    assert result["ratio_blocking_to_sync"] == pytest.approx(
        blocking_ratio, rel=0, abs=blocking_ratio * (half / seconds["blocking"] + half / seconds["sync"]) + 0.5e-4)
    sharded_ratio = save / seconds["plain"]
    assert result["ratio_sharded_to_plain"] == pytest.approx(
        sharded_ratio, rel=0, abs=sharded_ratio * (2 * half / save + half / seconds["plain"]) + 0.5e-4)
    # The first save's copy takes room for this rank's shards (the staging buffers), never the whole model.
    memory = result["peak_extra_memory_over_shard"]
    assert set(memory) == {"first_blocking", "blocking", "sync", "restore"}
    assert 0.5 <= memory["first_blocking"] < 2.0, memory
    assert result["restore_2_to_1_seconds"] > 0
    assert list(tmp_path.iterdir()) == [out], "the checkpoints go into a temporary directory that is removed"


def test_bench_checkpoint_sharded_names_a_bad_size(capsys):
    assert main(["bench", "checkpoint", "--sharded", "--gib", "0"]) == 2
    assert "--gib 0.0: expected 0.1 to 64" in capsys.readouterr().err
