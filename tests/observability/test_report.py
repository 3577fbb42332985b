"""Comparison reports: `compare` runs real variants locally; the report's tables match the runs' summaries."""

from __future__ import annotations

import json

import pytest
import yaml
from support import ROOT, job_doc

from kubetrain.api import from_object
from kubetrain.drivers.local.runner import LocalRunner
from kubetrain.drivers.local.rundir import RunDir
from kubetrain.reports import ReportError, build_report, compare
from kubetrain.reports.compare import variants
from kubetrain.reports.report import FIGURES

PNG = b"\x89PNG\r\n\x1a\n"


def small_job(name: str = "cmp") -> dict:
    return job_doc(
        name, "Single",
        model={"name": "mlp", "args": {"hidden": 32}}, dataset={"name": "digits"},
        training={"maxSteps": 60, "batchSize": 32, "seed": 0,
                  "optimizer": {"name": "sgd", "learningRate": 0.05, "momentum": 0.9}},
        checkpoint={"intervalSteps": 20, "keepLast": 2},
    )


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    """compare(Single, ParameterServer), plus a Single run whose replica was killed at step 30."""
    root = tmp_path_factory.mktemp("compare")
    manifest = root / "cmp.yaml"
    manifest.write_text(yaml.safe_dump(small_job()))
    report = compare(manifest, ["Single", "ParameterServer"], None, root / "out")
    faulted = root / "faulted"
    job = from_object(small_job("cmp-faulted"))
    assert LocalRunner(job, RunDir(faulted), {"single-0": "kill@step=30"}, echo_logs=False).run_job() == 0
    runs = sorted((root / "out" / "runs").iterdir()) + [faulted]
    full = build_report(runs, root / "full")
    return report, full, runs


def table(markdown: str, heading: str) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the first table under `## heading`."""
    section = markdown.split(f"## {heading}\n", 1)[1]
    lines = [line for line in section.split("\n## ", 1)[0].splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    return cells[0], cells[2:]


def number(cell: str) -> float | None:
    return None if cell == "-" else float(cell)


@pytest.mark.slow
def test_compare_runs_each_mode_and_reports_it(compared):
    report, _, runs = compared
    assert [r.name for r in runs[:2]] == ["cmp-ps", "cmp-single"]
    _, rows = table(report.read_text(), "Runs")
    assert {(r[0], r[2], r[4]) for r in rows} == {("cmp-single", "Single", "Succeeded"),
                                                 ("cmp-ps", "ParameterServer", "Succeeded")}
    for name in ("cmp-single", "cmp-ps"):
        manifest = yaml.safe_load((report.parent / "manifests" / f"{name}.yaml").read_text())
        assert manifest["metadata"]["name"] == name


@pytest.mark.slow
def test_summary_table_matches_the_summaries_with_ratios_to_the_first_run(compared):
    _, full, runs = compared
    summaries = [json.loads((r / "summary.json").read_text()) for r in runs]
    header, rows = table(full.read_text(), "Summary")
    labels = [r.name for r in runs]
    assert header == ["figure", *labels, *(f"{label} / {labels[0]}" for label in labels[1:])]
    assert [row[0] for row in rows] == list(FIGURES)
    for row in rows:
        key = row[0]
        values = [number(c) for c in row[1 : 1 + len(runs)]]
        ratios = [number(c) for c in row[1 + len(runs) :]]
        for value, summary in zip(values, summaries):
            expected = summary[key]
            if expected is None:
                assert value is None, key
            else:
                assert value == pytest.approx(expected, rel=1e-5), key
        for value, ratio in zip(values[1:], ratios):
            if ratio is None:
                assert not values[0] or value is None, f"{key}: ratio missing"
            else:
                assert ratio == pytest.approx(value / values[0], abs=1e-3), key


@pytest.mark.slow
def test_report_shows_the_restart_and_its_recovery(compared):
    _, full, runs = compared
    header, rows = table(full.read_text(), "Restarts and recovery")
    assert len(rows) == 1
    row = dict(zip(header, rows[0]))
    assert (row["run"], row["replica"], row["exit code"]) == ("faulted", "single-0", "137")
    # Killed right after step 30, before its checkpoint: resumed from step 20, or from 0 when the
    # checkpoint of step 20 was still being persisted in the background. The failure's step is the
    # last one the supervisor saw reported, at most 30.
    failed, resumed = number(row["failed at step"]), number(row["resumed from step"])
    assert resumed in (0, 20) and resumed <= failed <= 30
    assert number(row["steps lost"]) == failed - resumed
    assert 0 < number(row["recovery seconds"]) < 120
    state = json.loads((runs[-1] / "state.json").read_text())
    assert state["status"]["restarts"] == 1


@pytest.mark.slow
def test_report_plots_are_pngs_the_markdown_links(compared):
    _, full, _ = compared
    text = full.read_text()
    for name in ("loss", "accuracy", "throughput", "bytes_per_step", "recovery"):
        png = full.parent / f"{name}.png"
        assert png.read_bytes()[:8] == PNG, name
        assert f"({name}.png)" in text, name
    data = json.loads((full.parent / "report.json").read_text())
    assert sorted(data["plots"]) == sorted(f"{n}.png" for n in ("loss", "accuracy", "throughput", "bytes_per_step",
                                                                "recovery"))


@pytest.mark.slow
def test_bytes_per_step_are_the_runs_bytes_over_their_steps(compared):
    _, full, runs = compared
    _, rows = table(full.read_text(), "Bytes per step")
    by_run = {row[0]: [number(c) for c in row[1:]] for row in rows}
    ps = json.loads((runs[0] / "summary.json").read_text())
    assert by_run["cmp-ps"][0] == pytest.approx(ps["bytes_sent"] / ps["steps"], rel=1e-5)
    assert by_run["cmp-ps"][1] > 0 and by_run["cmp-single"] == [0, 0, 0]


@pytest.mark.parametrize(
    "name, modes, compression, expected",
    [
        ("one mode", ["Single"], None, ["cmp-single"]),
        ("modes", ["Single", "ParameterServer", "DDP"], None, ["cmp-single", "cmp-ps", "cmp-ddp"]),
        ("ps compression", ["Single", "ParameterServer"], ["None", "TopK"], ["cmp-single", "cmp-ps-none", "cmp-ps-topk"]),
        ("ddp hooks", ["DDP"], ["FP16", "TopK"], ["cmp-ddp-fp16"]),
    ],
)
def test_variants_of_a_manifest(name, modes, compression, expected):
    jobs = variants(from_object(small_job()), modes, compression)
    assert [j.name for j in jobs] == expected, name
    for job in jobs:
        assert (job.spec.parameter_server is not None) == (job.spec.mode == "ParameterServer")
        assert (job.spec.ddp is not None) == (job.spec.mode == "DDP")
    if compression and "TopK" in compression and "ParameterServer" in modes:
        assert jobs[-1].spec.parameter_server.compression.algorithm == "TopK"


@pytest.mark.parametrize(
    "modes, compression, message",
    [
        (["Single", "Local"], None, "--modes"),
        ([], None, "--modes"),
        (["ParameterServer"], ["Zip"], "--compression"),
    ],
)
def test_variants_refuse_unknown_modes_and_compression(modes, compression, message):
    with pytest.raises(ValueError, match=message):
        variants(from_object(small_job()), modes, compression)


@pytest.mark.parametrize(
    "setup, message",
    [
        ("missing", "no such run directory"),
        ("empty", "no job.yaml"),
        ("unfinished", "has not ended"),
    ],
)
def test_report_on_bad_run_directories_names_the_problem(tmp_path, setup, message):
    run = tmp_path / "run"
    if setup != "missing":
        run.mkdir()
    if setup == "unfinished":
        RunDir(run).prepare(from_object(small_job()))
    with pytest.raises(ReportError, match=message) as err:
        build_report([run], tmp_path / "out")
    assert str(run) in str(err.value)


def test_compare_variants_keep_the_global_batch():
    from kubetrain.api import load_one
    from kubetrain.reports.compare import variants

    job = load_one(ROOT / "examples" / "quickstart.yaml")  # 2 workers x 32
    by_mode = {v.spec.mode: v for v in variants(job, ["Single", "ParameterServer", "DDP"], None)}
    assert by_mode["Single"].spec.training.batch_size == 64
    assert by_mode["ParameterServer"].spec.training.batch_size == 32
    assert by_mode["DDP"].spec.training.batch_size == 32  # 2 nodes x 1 rank
