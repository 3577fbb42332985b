"""`kubetrain run` with data and checkpoints in object storage (the real S3 server): jobs read their data from
s3:// shards and checkpoint to s3://, a replica killed mid-training (or mid-upload) resumes from the newest
commit and ends where the fault-free run ends, and every bad URI or credential fails naming the URI, with no
traceback and no secret in any output."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from helpers.jsonl import read_events
from objstorelib import DIGITS_SHARDS, put_digits, secret_free, tree
from support import EXAMPLES, ROOT, job_doc, kubetrain
from kubetrain.api import load_one
from kubetrain.api.identity import JobIdentity
from kubetrain.trainer.object_checkpoints import ObjectCheckpointStore
from kubetrain.trainer.objstore import ObjectURI
from kubetrain.trainer.shards import eval_shards

SHARDS = DIGITS_SHARDS


def run(tmp_path: Path, s3, doc: dict, name: str, *args: str):
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    run_dir = tmp_path / name
    proc = kubetrain("run", str(path), "--run-dir", str(run_dir), "--quiet", *args, env=s3.env)
    everything = proc.stdout + proc.stderr + "".join(p.read_text() for p in (run_dir / "logs").glob("*.log")) \
        if (run_dir / "logs").is_dir() else proc.stdout + proc.stderr
    secret_free(everything, s3, f"the output and logs of {name}")
    return proc, run_dir


def newest_state(s3, uri: str, replica: str, run_dir: Path) -> tuple[int, dict]:
    """The newest committed checkpoint of `replica` under the job's URI, read back as a restart reads it."""
    spec = load_one(run_dir / "job.yaml").spec
    store = ObjectCheckpointStore(run_dir / "reread" / replica, _prefix(uri, replica), 100, JobIdentity.of(spec),
                                  store=s3.store())
    return store.load_latest()


def _prefix(uri: str, replica: str) -> ObjectURI:
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return ObjectURI(bucket, f"{key}{replica}/")


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


# 64 -> 1536 -> 1536 -> 10 with SGD momentum: about 20 MB a checkpoint, past objstore.MULTIPART_BYTES, so that
# a kill in the middle of an upload leaves a multipart upload half sent.
BIG_MLP = {"name": "mlp", "args": {"hidden": 1536, "layers": 2}}


def test_a_single_job_killed_mid_training_or_mid_upload_resumes_to_the_fault_free_weights(tmp_path, s3, bucket):
    data = put_digits(s3.store(), bucket)

    def doc(name: str) -> dict:
        return job_doc(name, model=BIG_MLP, dataset={"uri": data, "evalFraction": 0.25},
                       training={"epochs": 2, "batchSize": 32, "seed": 7},
                       checkpoint={"intervalSteps": 20, "storage": {"uri": f"s3://{bucket}/{name}/"}})

    clean, clean_dir = run(tmp_path, s3, doc("clean"), "clean")
    assert clean.returncode == 0, clean.stderr
    step_a, state_a = newest_state(s3, f"s3://{bucket}/clean/", "single-0", clean_dir)
    sizes = [len(part) for part in np.array_split(np.arange(1797), SHARDS)]
    train = sum(n for i, n in enumerate(sizes) if i not in eval_shards(SHARDS, 0.25, 7))
    for name, fault, resumed in (("step", "kill@step=45", ([20], [40])), ("save", "kill@save=40", ([20],))):
        faulty, faulty_dir = run(tmp_path, s3, doc(name), name, "--fault", f"single-0:{fault}")
        assert faulty.returncode == 0, faulty.stderr
        assert "single-0 was killed by SIGKILL; restart 1 of 6." in faulty.stderr
        # kill@step: step 40 may still have been uploading at the kill; kill@save: killed halfway through
        # step 40's upload, so its commit was never written.
        assert [r["step"] for r in read_events(faulty_dir / "metrics" / "single-0.jsonl", "resume")] in resumed
        step_b, state_b = newest_state(s3, f"s3://{bucket}/{name}/", "single-0", faulty_dir)
        assert step_a == step_b
        assert_same_weights(state_a["model"], state_b["model"])  # bitwise: the same batches, resumed at the sample
        # Counted: every training sample of every epoch trained once (6 shards train, 2 evaluate).
        results = [json.loads((d / "results" / "single-0.json").read_text()) for d in (clean_dir, faulty_dir)]
        assert results[0]["samples"] == results[1]["samples"] == 2 * train
        # What the kill left (an object without a commit, a multipart upload never completed) is gone.
        prefix = ObjectURI(bucket, f"{name}/single-0/")
        assert s3.store().abort_incomplete(prefix) == 0
        left = tree(s3.store(), ObjectURI(bucket, f"{name}/"))
        commits = {k.split("/")[-1].removesuffix(".pt.json") for k in left if "/commits/" in k}
        objects = {k.split("/")[-1].rsplit("-", 1)[0] for k in left if k.startswith("single-0/ckpt-")}
        assert commits == objects and len(commits) == 3, left  # keepLast 3, each object with its commit
        assert "job.yaml" in left

    # The tools read the bucket as they read a volume: verify, compare, and export to s3:// and to a file.
    verified = kubetrain("checkpoints", "verify", f"s3://{bucket}/save/", "--no-eval", "--json", env=s3.env)
    assert verified.returncode == 0, verified.stderr
    report = json.loads(verified.stdout)
    assert report["ok"] and report["replicas"]["single-0"]["latest"] == f"ckpt-{step_a:08d}.pt", report
    assert [c["step"] for c in report["replicas"]["single-0"]["checkpoints"] if c["ok"]] == [60, 80, step_a]
    same = kubetrain("checkpoints", "compare", f"s3://{bucket}/clean/", f"s3://{bucket}/save/", "--json", env=s3.env)
    assert same.returncode == 0, same.stdout + same.stderr
    exported = kubetrain("checkpoints", "export", f"s3://{bucket}/save/", "--out",
                         f"s3://{bucket}/exports/model.safetensors", "--format", "safetensors", env=s3.env)
    assert exported.returncode == 0, exported.stderr
    from safetensors.torch import load

    assert_same_weights(load(s3.store().get_bytes(ObjectURI(bucket, "exports/model.safetensors"), 1 << 30)),
                        state_a["model"])
    from_run = kubetrain("checkpoints", "export", str(clean_dir), "--out", str(tmp_path / "model.pt"), env=s3.env)
    assert from_run.returncode == 0, from_run.stderr
    assert_same_weights(torch.load(tmp_path / "model.pt", weights_only=True), state_a["model"])
    for out in (verified, same, exported, from_run):
        secret_free(out.stdout + out.stderr, s3)


def test_ddp_and_parameter_server_jobs_read_s3_shards_checkpoint_to_s3_and_survive_a_kill(tmp_path, s3, bucket):
    data = put_digits(s3.store(), bucket)
    common = dict(model={"name": "mlp", "args": {"hidden": 32}}, dataset={"uri": data, "evalFraction": 0.25},
                  training={"epochs": 4, "batchSize": 16, "seed": 3})

    def doc(name: str, mode: str, **extra) -> dict:
        return job_doc(name, mode, checkpoint={"intervalSteps": 20, "storage": {"uri": f"s3://{bucket}/{name}/"}},
                       **common, **extra)

    # DDP, 2 nodes: examples/s3 (its put_digits.py makes the bucket and the shards). Rank 0 writes the group's
    # checkpoints to <uri>/ddp-0/, every node reads them.
    made = subprocess.run([sys.executable, str(EXAMPLES / "s3" / "put_digits.py")], env=s3.environ(),
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0 and "8 shards of 1797 digits in s3://kubetrain-examples/digits/" in made.stdout, made

    def example(name: str) -> dict:
        doc = yaml.safe_load((EXAMPLES / "s3" / "job.yaml").read_text())
        doc["metadata"]["name"] = name
        doc["spec"]["training"]["epochs"] = 3  # 63 steps at 2 nodes: the kill at step 50 lands mid-run,
        doc["spec"]["checkpoint"]["intervalSteps"] = 20  # after the checkpoint of step 40
        doc["spec"]["checkpoint"]["storage"]["uri"] = f"s3://{bucket}/{name}/"
        return doc

    clean, clean_dir = run(tmp_path, s3, example("ddp-clean"), "ddp-clean")
    assert clean.returncode == 0, clean.stderr
    faulty, faulty_dir = run(tmp_path, s3, example("ddp-faulty"), "ddp-faulty", "--fault", "ddp-1:kill@step=50")
    assert faulty.returncode == 0, faulty.stderr
    step_a, state_a = newest_state(s3, f"s3://{bucket}/ddp-clean/", "ddp-0", clean_dir)
    step_b, state_b = newest_state(s3, f"s3://{bucket}/ddp-faulty/", "ddp-0", faulty_dir)
    resumed = [e["step"] for e in read_events(faulty_dir / "metrics" / "ddp-0.jsonl", "resume")]
    assert step_a == step_b and resumed in ([40], [20]), resumed  # 40 may still have been uploading at the kill
    assert_same_weights(state_a["model"], state_b["model"])
    assert not [k for k in tree(s3.store(), ObjectURI(bucket, "ddp-faulty/")) if k.startswith("ddp-1/")]

    # ParameterServer, 1 shard and 2 workers: ps-0 checkpoints to <uri>/ps-0/, the workers read the shards.
    ps = {"parameterServer": {"replicas": 1, "workers": 2}}
    clean, clean_dir = run(tmp_path, s3, doc("ps-clean", "ParameterServer", **ps), "ps-clean")
    assert clean.returncode == 0, clean.stderr
    faulty, faulty_dir = run(tmp_path, s3, doc("ps-faulty", "ParameterServer", **ps), "ps-faulty",
                             "--fault", "ps-0:kill@step=60")
    assert faulty.returncode == 0, faulty.stderr
    assert "ps-0 was killed by SIGKILL" in faulty.stderr
    assert read_events(faulty_dir / "metrics" / "ps-0.jsonl", "resume")
    accuracy = [json.loads((d / "summary.json").read_text())["eval_accuracy"] for d in (clean_dir, faulty_dir)]
    print(f"\nParameterServer from s3://: accuracy {accuracy[0]:.4f} fault-free, {accuracy[1]:.4f} with ps-0 killed")
    assert accuracy[1] >= accuracy[0] - 0.03  # asynchronous arrival: the PS is equal within its band, not bitwise
    assert any(k.startswith("ps-0/commits/") for k in tree(s3.store(), ObjectURI(bucket, "ps-faulty/")))


def test_a_script_reads_s3_shards_through_kubetrain_data_and_a_kill_loses_no_sample(tmp_path, s3, bucket):
    data = put_digits(s3.store(), bucket)
    epochs = 3
    doc = job_doc("counter", script={"command": ["python", "shard_counter.py", data, str(epochs)],
                                      "workingDir": str(ROOT / "tests" / "assets" / "scripts")},
                  checkpoint={"storage": {"uri": f"s3://{bucket}/counter/"}})
    proc, run_dir = run(tmp_path, s3, doc, "counter", "--fault", "single-0:kill@step=25")
    assert proc.returncode == 0, proc.stderr
    assert "single-0 was killed by SIGKILL" in proc.stderr
    assert [e["step"] for e in read_events(run_dir / "metrics" / "single-0.jsonl", "resume")] in ([10], [20])
    # Counted in the checkpointed state: every digit trained exactly once an epoch, the kill notwithstanding.
    metrics = json.loads((run_dir / "results" / "single-0.json").read_text())["metrics"]
    assert (metrics["min_count"], metrics["max_count"], metrics["trained"]) == (epochs, epochs, epochs * 1797)


@dataclass
class Bad:
    name: str
    dataset: dict
    words: str
    env: dict | None = None
    checkpoint: dict | None = None


BAD = [
    Bad("missing bucket", {"uri": "s3://no-such-bucket-kt/digits/"}, "no such bucket 'no-such-bucket-kt'"),
    Bad("missing object", {"uri": "s3://{bucket}/nothing.npz"}, "no such object"),
    Bad("empty prefix", {"uri": "s3://{bucket}/empty/"}, "no shards"),
    Bad("corrupt shard", {"uri": "s3://{bucket}/digits/"}, "part-009.npz: a corrupt or unusable shard"),
    Bad("denied credentials", {"uri": "s3://{bucket}/digits/"}, "access denied",
        env={"AWS_SECRET_ACCESS_KEY": "a-wrong-secret-of-the-right-length"}),
    Bad("checkpoints to a missing bucket", {"uri": "s3://{bucket}/digits/"}, "no such bucket 'no-ckpt-bucket-kt'",
        checkpoint={"storage": {"uri": "s3://no-ckpt-bucket-kt/run/"}}),
]


@pytest.mark.parametrize("case", BAD, ids=[c.name for c in BAD])
def test_bad_uris_and_credentials_fail_with_exit_3_naming_the_uri(tmp_path, s3, bucket, case):
    put_digits(s3.store(), bucket)
    if case.name == "corrupt shard":
        s3.store().put_bytes(ObjectURI(bucket, "digits/part-009.npz"), b"PK\x03\x04 truncated")
    dataset = {k: v.format(bucket=bucket) for k, v in case.dataset.items()}
    doc = job_doc("bad", dataset=dataset, training={"maxSteps": 5},
                  checkpoint=case.checkpoint or {"storage": {"uri": f"s3://{bucket}/bad/"}})
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(doc))
    env = {**s3.env, **(case.env or {})}
    proc = kubetrain("run", str(path), "--run-dir", str(tmp_path / "run"), "--quiet", env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out
    assert case.words in out and "s3://" in out, out
    assert "Traceback" not in out
    assert "restart 1 of" not in out  # a permanent failure is not retried
    secret_free(out + "".join(p.read_text() for p in (tmp_path / "run" / "logs").glob("*.log")), s3)
    for value in (case.env or {}).values():
        assert value not in out
