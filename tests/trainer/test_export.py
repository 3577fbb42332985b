"""`kubetrain checkpoints export`: the weights of a job's newest usable checkpoint as a plain state_dict file."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml

from support import job_doc, kubetrain
from kubetrain.api import load_one
from kubetrain.cli import main
from kubetrain.trainer.checkpoint import CheckpointStore, read_valid
from kubetrain.trainer.data import load_data
from kubetrain.trainer.models import build_model
from kubetrain.trainer.ps.job import shards_of
from kubetrain.trainer.verify import final_parameters

# Small: digits, a narrow MLP, a few dozen steps; checkpoints every few steps so there are several.
SPEC = {
    "model": {"name": "mlp", "args": {"hidden": 32}},
    "dataset": {"name": "digits", "evalFraction": 0.2},
    "training": {"maxSteps": 30, "batchSize": 64, "seed": 0, "device": "cpu",
                 "optimizer": {"name": "sgd", "learningRate": 0.05, "momentum": 0.9}},
    "checkpoint": {"intervalSteps": 10, "keepLast": 3},
    "metrics": {"port": 0},
}
PS_SPEC = {
    **SPEC,
    "training": {**SPEC["training"], "maxSteps": 20, "batchSize": 32},
    "parameterServer": {"replicas": 2, "workers": 2, "aggregation": "Sync"},
    "checkpoint": {"intervalSteps": 5, "keepLast": 3},
}


def run_job(root: Path, doc: dict) -> Path:
    manifest = root / "job.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    run = root / "run"
    proc = kubetrain("run", str(manifest), "--run-dir", str(run), "--quiet")
    assert proc.returncode == 0, proc.stderr
    return run


@pytest.fixture(scope="module")
def single_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished Single job (checkpoints of steps 10, 20, 30); tests that change it work on a copy."""
    return run_job(tmp_path_factory.mktemp("single"), job_doc("export-single", "Single", **SPEC))


@pytest.fixture(scope="module")
def ps_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished ParameterServer job with 2 shards (checkpoints of steps 10, 15, 20 on each)."""
    return run_job(tmp_path_factory.mktemp("ps"), job_doc("export-ps", "ParameterServer", **PS_SPEC))


@dataclass
class Result:
    code: int
    out: str
    err: str


def export(capsys: pytest.CaptureFixture[str], *args: str | Path) -> Result:
    capsys.readouterr()
    code = main(["checkpoints", "export", *map(str, args)])
    captured = capsys.readouterr()
    return Result(code, captured.out, captured.err)


def outputs(run: Path, state_dict: dict | None) -> torch.Tensor:
    """Eval-split logits of the job's model, built as the trainer builds it, holding `state_dict` (None: as built)."""
    spec = load_one(run / "job.yaml").spec
    data = load_data(spec.dataset, spec.training.seed)
    model = build_model(spec.model, data.input_shape, data.num_classes, spec.training.seed)
    if state_dict is not None:
        model.load_state_dict(state_dict)  # strict: exactly the model's keys
    model.eval()
    with torch.no_grad():
        return model(data.eval_x)


def copy_run(run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run, tmp_path / "run"))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def test_single_job_exports_the_model_of_its_newest_checkpoint(single_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "model.pt"
    proc = kubetrain("checkpoints", "export", str(single_run), "--out", str(out))  # the real command
    assert proc.returncode == 0, proc.stderr
    assert "the model (Single) at step 30: 4 tensors" in proc.stdout
    exported = torch.load(out, weights_only=True)
    info, state = next(read_valid(single_run / "checkpoints" / "single-0"))  # the checkpoint's own model
    assert info.step == 30
    assert set(exported) == set(state["model"])
    torch.testing.assert_close(outputs(single_run, exported), outputs(single_run, state["model"]), rtol=0, atol=0)
    assert not torch.equal(outputs(single_run, exported), outputs(single_run, None))  # trained, not the initial one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]  # no temporary file left


def test_replica_directory_exports_the_same_as_the_run_directory(single_run: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    assert export(capsys, single_run, "--out", a).code == 0
    assert export(capsys, single_run / "checkpoints" / "single-0", "--out", b).code == 0
    ta, tb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def test_corrupt_newest_checkpoint_falls_back_to_the_previous_one(single_run: Path, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    run = copy_run(single_run, tmp_path)
    replica = run / "checkpoints" / "single-0"
    newest = replica / "ckpt-00000030.pt"
    truncate(newest)
    result = export(capsys, run, "--out", tmp_path / "model.pt")
    assert result.code == 0, result.err
    assert "step 20" in result.out
    assert f"skipped {newest}: corrupt: payload is" in result.err
    assert newest.exists()  # read only: the copy is not ours to rename
    _, previous = CheckpointStore._read(replica / "ckpt-00000020.pt")
    torch.testing.assert_close(outputs(run, torch.load(tmp_path / "model.pt", weights_only=True)),
                               outputs(run, previous["model"]), rtol=0, atol=0)


def test_parameter_server_shards_are_merged_into_the_models_state_dict(ps_run: Path, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    result = export(capsys, ps_run, "--out", tmp_path / "model.pt")
    assert result.code == 0, result.err
    final = final_parameters(ps_run)  # the checkpoints' own model: both shards' params of the newest common step
    assert f"step {final['step']}" in result.out and "(ParameterServer, 2 shards merged)" in result.out
    exported = torch.load(tmp_path / "model.pt", weights_only=True)
    torch.testing.assert_close(outputs(ps_run, exported), outputs(ps_run, final["params"]), rtol=0, atol=0)


def test_copied_shard_directories_export_the_same_model_in_either_form(ps_run: Path, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    copied = Path(shutil.copytree(ps_run / "checkpoints", tmp_path / "pvc"))  # no job.yaml anywhere near
    expected = torch.load(_export_to(capsys, tmp_path / "run.pt", ps_run), weights_only=True)
    for name, sources in [("holding", [copied]), ("several", [copied / "ps-1", copied / "ps-0"])]:
        result = export(capsys, *sources, "--out", tmp_path / f"{name}.pt")
        assert result.code == 0, result.err
        assert "--job" in result.err  # the shard count could not be checked
        got = torch.load(tmp_path / f"{name}.pt", weights_only=True)
        assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got), name


def _export_to(capsys: pytest.CaptureFixture[str], out: Path, *sources: Path) -> Path:
    result = export(capsys, *sources, "--out", out)
    assert result.code == 0, result.err
    return out


def test_a_shards_corrupt_newest_checkpoint_moves_every_shard_to_an_older_common_step(
        ps_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = copy_run(ps_run, tmp_path)
    steps = [info.step for info, _ in read_valid(run / "checkpoints" / "ps-1")]
    truncate(run / "checkpoints" / "ps-1" / f"ckpt-{steps[0]:08d}.pt")
    result = export(capsys, run, "--out", tmp_path / "model.pt")
    assert result.code == 0, result.err
    assert f"step {steps[1]}" in result.out
    assert f"ps-0/ckpt-{steps[1]:08d}.pt" in result.out and f"ps-1/ckpt-{steps[1]:08d}.pt" in result.out


def test_a_missing_shard_is_refused_naming_it_and_its_parameters(ps_run: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    job = load_one(ps_run / "job.yaml")
    data = load_data(job.spec.dataset, job.spec.training.seed)
    model = build_model(job.spec.model, data.input_shape, data.num_classes, job.spec.training.seed)
    held_by_ps_1 = shards_of(model, 2)[1]
    shard = Path(shutil.copytree(ps_run / "checkpoints" / "ps-0", tmp_path / "pvc" / "ps-0"))
    out = tmp_path / "model.pt"
    result = export(capsys, shard, "--job", ps_run / "job.yaml", "--out", out)
    assert result.code == 3
    [line] = result.err.splitlines()
    assert "shard ps-1 of 2 missing" in line and ", ".join(held_by_ps_1) in line
    # Without the job the shard names still give a gap away.
    other = Path(shutil.copytree(ps_run / "checkpoints" / "ps-1", tmp_path / "other" / "ps-1"))
    result = export(capsys, other, "--out", out)
    assert result.code == 3 and "shard ps-0 of at least 2 missing" in result.err
    assert not out.exists()


def test_script_checkpoint_exports_the_saved_state_as_it_is(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    state = {"net": {"w": torch.randn(3, 2), "b": torch.zeros(2)}, "epoch": 4, "tag": "best",
             "history": [1.5, 0.25]}
    store = CheckpointStore(tmp_path / "ckpt", keep_last=3, identity="any", background=False)
    store.save(3, {"net": {"w": torch.ones(1)}})
    store.save(8, state)
    result = export(capsys, tmp_path / "ckpt", "--out", tmp_path / "state.pt")
    assert result.code == 0, result.err
    assert "(script)" in result.out and "step 8" in result.out and "2 tensors" in result.out
    got = torch.load(tmp_path / "state.pt", weights_only=True)
    assert got.keys() == state.keys() and got["epoch"] == 4 and got["tag"] == "best" and got["history"] == [1.5, 0.25]
    assert torch.equal(got["net"]["w"], state["net"]["w"]) and torch.equal(got["net"]["b"], state["net"]["b"])


def test_script_job_exports_its_state_whole_even_when_its_keys_look_built_in(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    run.mkdir()
    doc = job_doc("custom", "Single", script={"command": ["python", "train.py"]})
    (run / "job.yaml").write_text(yaml.safe_dump(doc))
    state = {"model": {"w": torch.ones(2)}, "optimizer": {}, "cursor": 5, "rng": torch.zeros(1)}
    CheckpointStore(run / "checkpoints" / "single-0", 3, "any", background=False).save(5, state)
    result = export(capsys, run, "--out", tmp_path / "state.pt")
    assert result.code == 0, result.err
    assert "(script, Single)" in result.out
    assert torch.load(tmp_path / "state.pt", weights_only=True).keys() == state.keys()


@pytest.mark.parametrize(
    ("name", "code", "message"),
    [
        ("source missing", 2, "{tmp}/nothere: no such directory"),
        ("no checkpoint", 3, "{tmp}/empty: no checkpoints here"),
        ("every checkpoint corrupt", 3, "{tmp}/run/checkpoints/single-0: no usable checkpoint, every one is corrupt"),
        ("out directory missing", 2, "{tmp}/missing: no such directory (the directory of --out"),
    ],
)
def test_bad_input_is_one_line_and_an_existing_file_is_left_alone(
        name: str, code: int, message: str, single_run: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "model.pt"
    out.write_bytes(b"the previous export")
    source = tmp_path / "run"
    if name == "source missing":
        source = tmp_path / "nothere"
    elif name == "no checkpoint":
        source = tmp_path / "empty"
        source.mkdir()
    elif name == "every checkpoint corrupt":
        copy_run(single_run, tmp_path)
        for ckpt in (source / "checkpoints" / "single-0").glob("ckpt-*.pt"):
            truncate(ckpt)
    elif name == "out directory missing":
        copy_run(single_run, tmp_path)
        out = tmp_path / "missing" / "model.pt"
    result = export(capsys, source, "--out", out)
    assert result.code == code
    errors = [line for line in result.err.splitlines() if "error:" in line]
    assert len(errors) == 1 and message.format(tmp=tmp_path) in errors[0], result.err
    assert "Traceback" not in result.err and result.out == ""
    if out.parent.exists():
        assert (tmp_path / "model.pt").read_bytes() == b"the previous export"
        assert not list(tmp_path.glob(".model.pt.*"))
