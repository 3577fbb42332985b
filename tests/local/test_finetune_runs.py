"""`kubetrain run` fine-tuning a pretrained Hugging Face model (model causal-lm): a 2-rank FSDP full fine-tune
from a sharded local model and a 2-rank LoRA fine-tune from object storage (the real S3 server) each lower the
held-out loss below the pretrained model's; a rank SIGKILLed mid-training resumes and ends on the fault-free
weights, bitwise; the Hugging Face export loads with from_pretrained (and peft) and gives the trained model's
logits; and every bad pretrained model fails before any training process starts, naming the URI."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from finetunelib import Pretrained, copy_model, make_model
from objstorelib import secret_free
from support import job_doc, kubetrain

pytestmark = pytest.mark.slow

LOGITS_TOLERANCE = 1e-5
"""float32 logits of the same weights through two code paths (kubetrain's wrapper, transformers' loader): the
same operations, so equal up to the order of a few sums."""


MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""LoRA on every linear layer of the decoder: a 64-wide model has little room in q and v alone."""


def training(learning_rate: float = 0.003, **extra) -> dict:
    return {"maxSteps": 40, "batchSize": 8, "seed": 3, "gradientAccumulationSteps": 2, "maxGradNorm": 1.0,
            "optimizer": {"name": "adamw", "learningRate": learning_rate, "weightDecay": 0.01, "warmupSteps": 5,
                          "schedule": "cosine"}, **extra}


def text(path_or_uri: str) -> dict:
    key = "uri" if path_or_uri.startswith("s3://") else "path"
    return {key: path_or_uri, "format": "text", "sequenceLength": 64, "evalFraction": 0.1}


def run(tmp_path: Path, doc: dict, name: str, *args: str, env: dict | None = None):
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    run_dir = tmp_path / name
    proc = kubetrain("run", str(path), "--run-dir", str(run_dir), "--quiet", *args, env=env or {})
    return proc, run_dir


def result(run_dir: Path, replica: str = "ddp-0") -> dict:
    return json.loads((run_dir / "results" / f"{replica}.json").read_text())


def newest(run_dir: Path) -> Path:
    return sorted((run_dir / "checkpoints" / "ddp-0").glob("sharded-*"))[-1]


def model_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    from kubetrain.trainer import sharded

    return sharded.load_whole(checkpoint)["model"]


def assert_equal_states(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def kubetrain_logits(model_dir: Path, state: dict, ids: torch.Tensor, lora: dict | None = None) -> torch.Tensor:
    """Logits of the trained model as kubetrain's own loop builds it: the pretrained model, the checkpoint over it."""
    from kubetrain.api.spec import Lora
    from kubetrain.trainer.causal_lm import CausalLM

    model = CausalLM(model_dir, Lora(**lora) if lora else None, seed=0)
    model.materialize(torch.device("cpu"))
    missing, unexpected = model.load_state_dict(state, strict=lora is None)
    assert not unexpected and (lora is None or all("lora_" not in k for k in missing))
    model.eval()
    with torch.no_grad():
        return model(ids)


def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


IDS = torch.randint(3, 500, (2, 48), generator=torch.Generator().manual_seed(0))


def test_fsdp_full_finetune_of_a_sharded_model_survives_a_kill_and_exports_a_hugging_face_model(
        tmp_path, pretrained: Pretrained):
    from transformers import AutoModelForCausalLM

    def doc(name: str) -> dict:
        return job_doc(name, "DDP", ddp={"nodes": 2, "strategy": "FSDP"},
                       model={"name": "causal-lm", "pretrained": str(pretrained.sharded)},
                       dataset=text(str(pretrained.corpus)), training=training(),
                       checkpoint={"intervalSteps": 10, "storage": {"accessMode": "ReadWriteMany"}},
                       metrics={"port": 0})

    clean, clean_dir = run(tmp_path, doc("clean"), "clean")
    assert clean.returncode == 0, clean.stderr
    faulty, faulty_dir = run(tmp_path, doc("faulty"), "faulty", "--fault", "ddp-1:kill@step=25")
    assert faulty.returncode == 0, faulty.stderr
    summary = json.loads((faulty_dir / "summary.json").read_text())
    assert summary["restarts"] >= 1, summary
    for run_dir in (clean_dir, faulty_dir):
        figures = result(run_dir)
        # The pretrained model's held-out loss is measured before the first step; fine-tuning beats it.
        print(f"{run_dir.name}: held-out loss {figures['baseline_eval_loss']:.4f} -> {figures['eval_loss']:.4f}")
        assert figures["eval_loss"] < figures["baseline_eval_loss"] - 0.02, figures
        assert figures["eval_perplexity"] == pytest.approx(torch.tensor(figures["eval_loss"]).exp().item())
    # The restarted group resumed from step 20's checkpoint (each rank its own shards) and ended bitwise equal.
    assert newest(clean_dir).name == newest(faulty_dir).name == "sharded-00000040"
    state = model_state(newest(clean_dir))
    assert_equal_states(state, model_state(newest(faulty_dir)))
    assert {k for k in state} and all(k.startswith("hf.") for k in state)

    out = tmp_path / "hf"
    export = kubetrain("checkpoints", "export", str(clean_dir), "--format", "huggingface", "--out", str(out),
                       "--max-shard-size", "300000")
    assert export.returncode == 0, export.stderr
    files = sorted(p.name for p in out.iterdir())
    assert "model.safetensors.index.json" in files and "tokenizer.json" in files and "config.json" in files
    assert len([f for f in files if f.startswith("model-")]) > 1, files
    exported = AutoModelForCausalLM.from_pretrained(out)
    diff = (hf_logits(exported, IDS) - kubetrain_logits(pretrained.sharded, state, IDS)).abs().max().item()
    assert diff <= LOGITS_TOLERANCE, diff
    again = kubetrain("checkpoints", "export", str(clean_dir), "--format", "huggingface", "--out", str(out))
    assert again.returncode == 2 and "not an empty directory" in again.stderr and "Traceback" not in again.stderr


def test_lora_finetune_from_object_storage_survives_a_kill_and_exports_adapter_and_merged_model(
        tmp_path, pretrained: Pretrained, s3, bucket):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from kubetrain.trainer.objstore import ObjectURI

    store = s3.store()
    for file in pretrained.single.iterdir():
        store.upload(file, ObjectURI(bucket, f"base/{file.name}"))
    store.upload(pretrained.corpus, ObjectURI(bucket, "text/finetune.jsonl"))
    lora = {"rank": 8, "alpha": 16.0, "targetModules": MODULES}

    def doc(name: str) -> dict:
        return job_doc(name, "DDP", ddp={"nodes": 2},
                       model={"name": "causal-lm", "pretrained": f"s3://{bucket}/base/"},
                       dataset=text(f"s3://{bucket}/text/finetune.jsonl"),
                       training=training(0.02, lora=lora),
                       checkpoint={"intervalSteps": 10}, metrics={"port": 0})

    clean, clean_dir = run(tmp_path, doc("clean"), "clean", env=s3.env)
    assert clean.returncode == 0, clean.stderr
    faulty, faulty_dir = run(tmp_path, doc("faulty"), "faulty", "--fault", "ddp-1:kill@step=25", env=s3.env)
    assert faulty.returncode == 0, faulty.stderr
    for run_dir in (clean_dir, faulty_dir):
        secret_free((run_dir / "logs" / "initializer-0.log").read_text(), s3, "the initializer's log")
        figures = result(run_dir)
        print(f"{run_dir.name}: held-out loss {figures['baseline_eval_loss']:.4f} -> {figures['eval_loss']:.4f}")
        assert figures["eval_loss"] < figures["baseline_eval_loss"] - 0.005, figures
        assert (run_dir / "cache" / "model" / "model.safetensors").is_file()
    # Only the adapters are checkpointed (DDP: rank 0's file), and the resumed run ends on the same ones.
    from kubetrain.trainer.checkpoint import read_valid

    def adapters(run_dir: Path) -> dict:
        info, state = next(read_valid(run_dir / "checkpoints" / "ddp-0", lambda p, r: None))
        assert info.step == 40
        return state["model"]

    state = adapters(clean_dir)
    assert state and all(".lora_" in k for k in state), sorted(state)[:4]
    assert_equal_states(state, adapters(faulty_dir))

    adapter_dir, merged_dir = tmp_path / "adapter", tmp_path / "merged"
    for out, extra in ((adapter_dir, []), (merged_dir, ["--merge-lora"])):
        done = kubetrain("checkpoints", "export", str(clean_dir), "--format", "huggingface", "--out", str(out),
                         *extra, env=s3.env)
        assert done.returncode == 0, done.stderr
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {
        p.name for p in adapter_dir.iterdir()}
    expected = kubetrain_logits(pretrained.single, state, IDS, lora={"rank": 8, "alpha": 16.0,
                                                                     "target_modules": MODULES})
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(pretrained.single), adapter_dir)
    assert (hf_logits(adapted, IDS) - expected).abs().max().item() <= LOGITS_TOLERANCE
    # The merged export is exactly peft's own merge of the same adapter into the same base.
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).state_dict()
    reference = adapted.merge_and_unload().state_dict()
    assert merged.keys() == reference.keys()
    for name in merged:
        assert torch.allclose(merged[name], reference[name], atol=1e-6, rtol=0), name


def _damaged(tmp_path: Path, pretrained: Pretrained, how: str) -> Path:
    model = copy_model(pretrained.sharded, tmp_path / how)
    if how == "no-weights":
        for file in model.glob("model*"):
            file.unlink()
    elif how == "index-names-missing-file":
        next(model.glob("model-00002-*")).unlink()
    elif how == "checksum":
        shard = next(model.glob("model-00001-*"))
        data = bytearray(shard.read_bytes())
        data[-1] ^= 0xFF  # one byte of the last tensor: the header still parses, only the digest tells
        shard.write_bytes(bytes(data))
    elif how == "truncated":
        shard = next(model.glob("model-00003-*"))
        shard.write_bytes(shard.read_bytes()[:-100])
    elif how == "no-config":
        (model / "config.json").unlink()
    return model


@pytest.mark.parametrize("how,message", [
    ("no-such-dir", "no such directory"),
    ("no-config", "no config.json"),
    ("no-weights", "no weights"),
    ("index-names-missing-file", "not in the directory"),
    ("checksum", "checksum mismatch"),
    ("truncated", "truncated"),
])
def test_a_bad_pretrained_model_fails_before_any_training_process_starts(tmp_path, pretrained, how, message):
    model = tmp_path / "absent" if how == "no-such-dir" else _damaged(tmp_path, pretrained, how)
    doc = job_doc("bad", "DDP", ddp={"nodes": 2}, model={"name": "causal-lm", "pretrained": str(model)},
                  dataset=text(str(pretrained.corpus)), training=training(), metrics={"port": 0})
    proc, run_dir = run(tmp_path, doc, "bad")
    assert proc.returncode == 3, proc.stderr
    assert f"{model}: " in proc.stderr and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr + (run_dir / "logs" / "initializer-0.log").read_text()
    assert not (run_dir / "logs" / "ddp-0.log").exists(), "a training process started"


def test_a_missing_pretrained_prefix_in_object_storage_fails_naming_the_uri(tmp_path, pretrained, s3, bucket):
    uri = f"s3://{bucket}/nothing-here/"
    doc = job_doc("bad", model={"name": "causal-lm", "pretrained": uri}, dataset=text(str(pretrained.corpus)),
                  training=training(), metrics={"port": 0})
    proc, run_dir = run(tmp_path, doc, "bad", env=s3.env)
    assert proc.returncode == 3 and f"{uri}: no objects under this prefix" in proc.stderr, proc.stderr
    assert not (run_dir / "logs" / "single-0.log").exists()
    secret_free(proc.stdout + proc.stderr, s3, "the output")
    shutil.rmtree(run_dir)


def test_the_finetune_examples_are_valid_and_the_lora_one_runs_as_its_comment_says(tmp_path, pretrained):
    """examples/finetune: both manifests validate; lora.yaml runs from the repository root's layout (its
    relative paths), its model and corpus as make_model.py makes them (here the session's, already made)."""
    from support import EXAMPLES

    for name in ("lora.yaml", "fsdp.yaml", "chat.yaml"):
        done = kubetrain("validate", str(EXAMPLES / "finetune" / name))
        assert done.returncode == 0, done.stderr
    layout = tmp_path / "examples" / "finetune"
    layout.mkdir(parents=True)
    (layout / "base-model").symlink_to(pretrained.single)
    (layout / "finetune.jsonl").symlink_to(pretrained.corpus)
    shutil.copyfile(EXAMPLES / "finetune" / "lora.yaml", layout / "lora.yaml")
    done = kubetrain("run", "examples/finetune/lora.yaml", "--quiet", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    figures = result(tmp_path / "runs" / "finetune-lora", "single-0")
    assert figures["eval_loss"] < figures["baseline_eval_loss"], figures
    export = kubetrain("checkpoints", "export", "runs/finetune-lora", "--format", "huggingface", "--out",
                       "runs/lora-adapter", cwd=tmp_path)
    assert export.returncode == 0 and (tmp_path / "runs" / "lora-adapter" / "adapter_config.json").is_file()


def test_the_chat_example_trains_on_answers_resumes_a_kill_exactly_and_exports_its_chat_template(
        tmp_path, pretrained):
    """examples/finetune/chat.yaml (LoRA on conversations, answers only, packed) as its comment says: killed at
    step 30 it resumes to the fault-free run's weights to the last bit (the merged exports compared), its
    answers' held-out loss falls, and the export carries the manifest's chat template: the exported tokenizer
    renders a conversation as the training's did."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from support import EXAMPLES

    layout = tmp_path / "examples" / "finetune"
    layout.mkdir(parents=True)
    (layout / "base-model").symlink_to(pretrained.single)
    assert make_model().write_chat(layout / "chat.jsonl") >= 40
    shutil.copyfile(EXAMPLES / "finetune" / "chat.yaml", layout / "chat.yaml")
    template = yaml.safe_load((layout / "chat.yaml").read_text())["spec"]["dataset"]["chatTemplate"]
    exports = {}
    for name, fault in (("free", ()), ("killed", ("--fault", "single-0:kill@step=30"))):
        done = kubetrain("run", "examples/finetune/chat.yaml", "--run-dir", f"runs/{name}", "--quiet", *fault,
                         cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        summary = json.loads((tmp_path / "runs" / name / "summary.json").read_text())
        assert summary["restarts"] == (1 if fault else 0), summary
        figures = result(tmp_path / "runs" / name, "single-0")
        assert figures["eval_loss"] < figures["baseline_eval_loss"], figures
        export = kubetrain("checkpoints", "export", f"runs/{name}", "--format", "huggingface", "--merge-lora",
                           "--out", f"runs/{name}-model", cwd=tmp_path)
        assert export.returncode == 0, export.stderr
        exports[name] = tmp_path / "runs" / f"{name}-model"
    assert_equal_states(load_file(exports["free"] / "model.safetensors"),
                        load_file(exports["killed"] / "model.safetensors"))

    assert (exports["killed"] / "chat_template.jinja").read_text() == template
    conversation = json.loads((layout / "chat.jsonl").read_text().splitlines()[0])["messages"]
    source = AutoTokenizer.from_pretrained(pretrained.single)
    assert not source.chat_template  # the template is the manifest's, not the pretrained tokenizer's
    source.chat_template = template
    exported = AutoTokenizer.from_pretrained(exports["killed"])
    for prompt in (conversation, conversation[:-1]):  # a whole conversation; one that asks for the next answer
        asks = prompt[-1]["role"] != "assistant"
        expected = source.apply_chat_template(prompt, tokenize=False, add_generation_prompt=asks)
        assert exported.apply_chat_template(prompt, tokenize=False, add_generation_prompt=asks) == expected


def test_a_script_job_finds_its_pretrained_model_fetched_and_checked_at_kubetrain_model_dir(tmp_path, pretrained,
                                                                                          s3, bucket):
    from kubetrain.trainer.objstore import ObjectURI

    store = s3.store()
    for file in pretrained.single.iterdir():
        store.upload(file, ObjectURI(bucket, f"base/{file.name}"))
    (tmp_path / "show.py").write_text(
        "import os, pathlib\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "where = os.environ['KUBETRAIN_MODEL_DIR']\n"
        "model = AutoModelForCausalLM.from_pretrained(where)\n"
        "AutoTokenizer.from_pretrained(where)\n"
        "print('MODEL', where, sum(p.numel() for p in model.parameters()))\n")
    doc = job_doc("script-pre", model={"name": "causal-lm", "pretrained": f"s3://{bucket}/base/"},
                  script={"command": ["python", "show.py"]}, metrics={"port": 0})
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    proc = kubetrain("run", str(path), "--run-dir", str(tmp_path / "run"), "--quiet", env=s3.env)
    assert proc.returncode == 0, proc.stderr
    said = (tmp_path / "run" / "logs" / "single-0.log").read_text()
    assert f"MODEL {tmp_path / 'run' / 'cache' / 'model'} 196928" in said, said
