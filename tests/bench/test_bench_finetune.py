"""`kubetrain bench finetune`: one tiny real run prints every figure, each ratio the quotient of the figures
printed beside it; bad arguments are named before anything runs. Speed is not asserted: the benchmark's
figures are in docs/benchmarks.md."""

from __future__ import annotations

import json

import pytest

from kubetrain.bench.finetune import RANKS, TOKENS_DECIMALS
from kubetrain.cli import main

TINY = ["--steps", "4", "--rounds", "1", "--seq", "32", "--batch", "2", "--hidden", "32", "--layers", "1",
        "--load-hidden", "64", "--load-layers", "1"]
"""Two Llamas of 0.15M and 1.1M parameters: the whole run takes about a minute on 2 cores."""
SPEED_FIGURES = ("", "_steady", "_median_step", "_cpu")


def assert_quotient(ratio: float, a: float, b: float, half_a: float, half_b: float, half_ratio: float) -> None:
    """`ratio` is a / b of the unrounded figures: a and b are printed off by half_a and half_b at most, the
    ratio by half_ratio; pytest.approx takes the larger of rel and abs, not their sum, so the sum is abs."""
    quotient = a / b
    assert ratio == pytest.approx(quotient, rel=0, abs=quotient * (half_a / a + half_b / b) + half_ratio), (ratio, a, b)


@pytest.mark.slow
def test_bench_finetune_measures_speed_loading_memory_and_export_in_one_run(tmp_path):
    out = tmp_path / "finetune.json"
    work = tmp_path / "work"
    assert main(["bench", "finetune", *TINY, "--keep", str(work), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result) >= {"speed", "load", "export", "aims", "load_average", "load_average_at_start"}

    speed = result["speed"]
    assert (speed["steps"], speed["rounds"], speed["ranks"]) == (4, 1, RANKS)
    assert speed["tokens_per_step"] == RANKS * 2 * 32
    half_tokens = 0.5 * 10.0 ** -TOKENS_DECIMALS
    (row,) = speed["per_round"]
    for suffix in SPEED_FIGURES:
        ours, theirs = speed[f"kubetrain_tokens_per_second{suffix}"], speed[f"hand_tokens_per_second{suffix}"]
        assert ours > 0 and theirs > 0
        assert_quotient(speed[f"ratio_tokens_per_second{suffix}"], ours, theirs, half_tokens, half_tokens, 0.5e-4)
        # One round: its figures are the medians.
        assert (row[f"kubetrain{suffix}"], row[f"hand{suffix}"]) == (ours, theirs)
    assert row["kubetrain_run_seconds"] > 0 and row["hand_run_seconds"] > 0
    assert speed["kubetrain_peak_rss_bytes"] > 0 and speed["hand_peak_rss_bytes"] > 0

    load = result["load"]
    assert load["shard_bytes"] == load["parameter_bytes"] // RANKS and load["files"] > 1
    for path in ("kubetrain", "naive"):
        figures = load[path]
        assert figures["peak_extra_rss_bytes"] > 0 and figures["peak_extra_anon_bytes"] > 0, figures
        # Every rank ends holding its half of the parameters (FSDP's chunks: the odd rows round up).
        assert load["shard_bytes"] <= figures["held_bytes"] <= load["shard_bytes"] * 1.01, figures
        for kind in ("rss", "anon"):
            assert_quotient(figures[f"{kind}_over_shard"], figures[f"peak_extra_{kind}_bytes"], load["shard_bytes"],
                            0, 0, 0.5e-3)

    export = result["export"]
    assert export["model_bytes"] == load["parameter_bytes"]
    assert export["files"] > 1 and export["safetensors_bytes"] >= export["model_bytes"]
    assert export["cli_seconds"] > 0 and export["cli_max_rss_bytes"] > 0 and export["inside_seconds"] > 0
    assert export["inside_peak_extra_rss_bytes"] > 0 and export["inside_peak_extra_anon_bytes"] > 0
    for kind in ("rss", "anon"):
        assert_quotient(export[f"extra_{kind}_over_model"], export[f"inside_peak_extra_{kind}_bytes"],
                        export["model_bytes"], 0, 0, 0.5e-3)
    assert_quotient(export["extra_anon_over_max_shard"], export["inside_peak_extra_anon_bytes"],
                    export["max_shard_bytes"], 0, 0, 0.5e-3)
    # --keep: the models, the runs and the exports stay for a look.
    assert {"speed-model", "load-model", "run-0", "export-run", "hf-cli"} <= {p.name for p in work.iterdir()}


@pytest.mark.parametrize("args, words", [
    (["--steps", "2"], "--steps 2: must be more than the 2 warm-up steps"),
    (["--rounds", "0"], "--rounds, --batch, --layers and --load-layers must be at least 1"),
    (["--seq", "4"], "--seq 4: expected 8 to 512"),
    (["--hidden", "30"], "--hidden 30: must be a positive multiple of 4"),
    (["--load-hidden", "100"], "--load-hidden 100: must be a positive multiple of 8"),
])
def test_bench_finetune_names_a_bad_argument(capsys, args, words):
    assert main(["bench", "finetune", *args]) == 2
    assert words in capsys.readouterr().err


def test_bench_finetune_refuses_to_keep_into_a_directory_in_use(tmp_path, capsys):
    (tmp_path / "something").write_text("")
    assert main(["bench", "finetune", "--keep", str(tmp_path)]) == 2
    assert f"--keep {tmp_path}: exists and is not an empty directory" in capsys.readouterr().err
