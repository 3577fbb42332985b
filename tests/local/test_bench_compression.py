"""`kubetrain bench compression`: the figures it derives from the replicas' results, and its bad input."""

import pytest

from kubetrain.bench.compression import bench_compression, figures, variant

QUICKSTART = "examples/quickstart.yaml"


def test_push_and_pull_bytes_per_step_come_from_the_workers_and_the_shards_sent_bytes():
    results = {
        "ps-0": {"bytes_sent": 3000, "whole_pulls": 3, "compressed_pulls": 7, "sparse_pull_tensors": 12},
        "worker-0": {"steps": 5, "bytes_sent": 500},
        "worker-1": {"steps": 5, "bytes_sent": 700},
    }
    row = figures(results, {"eval_accuracy": 0.9})
    assert row == {"eval_accuracy": 0.9, "worker_steps": 10, "push_bytes_per_step": 120, "pull_bytes_per_step": 300,
                   "total_bytes": 4200, "whole_pulls": 3, "compressed_pulls": 7, "sparse_pull_tensors": 12}


def test_a_variant_changes_only_the_compression_and_the_name():
    doc = {"metadata": {"name": "q"}, "spec": {"mode": "ParameterServer", "parameterServer": {"workers": 2}}}
    out = variant(doc, "TopK", 0.01, 2, 0)
    assert out["spec"]["parameterServer"] == {"workers": 2, "compression": {
        "algorithm": "TopK", "ratio": 0.01, "rank": 2, "minTensorBytes": 0}}
    assert out["metadata"]["name"] == "bench-topk" and doc["spec"]["parameterServer"] == {"workers": 2}


@pytest.mark.parametrize("doc, algorithms, message", [
    ({"spec": {"mode": "DDP"}}, ["None"], "spec.mode: bench compression needs a ParameterServer manifest"),
    (None, ["None", "Zip"], "--algorithms: unknown Zip"),
])
def test_bad_input_is_named_before_any_job_runs(tmp_path, doc, algorithms, message):
    manifest = QUICKSTART
    if doc is not None:
        manifest = tmp_path / "job.yaml"
        manifest.write_text(str(doc).replace("'", '"'))
    with pytest.raises(ValueError, match=message):
        bench_compression(str(manifest), algorithms, 0.01, 2, 0)
