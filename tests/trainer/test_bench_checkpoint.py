"""`kubetrain bench checkpoint`: one short real run prints its figures; bad arguments are named."""

from __future__ import annotations

import json

import pytest

from kubetrain_operator.cli import main


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
    assert list(tmp_path.iterdir()) == [out], "the checkpoints go into a temporary directory that is removed"


@pytest.mark.parametrize("args, words", [
    (["--model-mb", "10"], "--model-mb must be at least 100"),
    (["--every", "0"], "--every and --rounds at least 1"),
    (["--dir", "/nonexistent/place"], "--dir /nonexistent/place: not a directory"),
])
def test_bench_checkpoint_names_a_bad_argument(capsys, args, words):
    assert main(["bench", "checkpoint", *args]) == 2
    assert words in capsys.readouterr().err
