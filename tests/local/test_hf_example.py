"""examples/hf: a Hugging Face Trainer script with KubetrainCallback, killed and resumed, ends as if never killed."""

from __future__ import annotations

import json

import pytest

from helpers.jsonl import read_events
from support import EXAMPLES, kubetrain

JOB = EXAMPLES / "hf" / "job.yaml"


def run(tmp_path, name: str, *fault: str) -> tuple[dict, str, list[dict]]:
    run_dir = tmp_path / name
    proc = kubetrain("run", str(JOB), "--run-dir", str(run_dir), "--quiet", *fault)
    log = (run_dir / "logs" / "single-0.log").read_text()
    assert proc.returncode == 0, proc.stderr + log[-3000:]
    return json.loads((run_dir / "summary.json").read_text()), log, read_events(run_dir / "metrics" / "single-0.jsonl")


@pytest.mark.slow
def test_a_trainer_killed_after_a_save_resumes_from_it_and_ends_with_the_fault_free_loss(tmp_path):
    clean, _, clean_events = run(tmp_path, "clean")
    faulted, log, events = run(tmp_path, "faulted", "--fault", "single-0:kill@step=30")
    assert (clean["state"], clean["restarts"], faulted["state"], faulted["restarts"]) == \
        ("Succeeded", 0, "Succeeded", 1)
    # Killed at step 30 (a logging step, past the save of step 20): the Trainer resumed from kubetrain's step 20.
    assert "kubetrain: resuming the Trainer from kubetrain's checkpoint of step 20" in log
    assert [e["step"] for e in events if e["event"] == "resume"] == [20]
    # The Trainer's own resume skipped the batches trained and restored the RNG and the schedule: every loss
    # after the restart is the fault-free run's, bit for bit, and so is the last.
    losses = {e["step"]: e["loss"] for e in clean_events if e["event"] == "train" and "loss" in e}
    resumed = [(e["step"], e["loss"]) for e in events[[e["event"] for e in events].index("resume"):]
               if e["event"] == "train" and "loss" in e]
    assert resumed and all(losses[step] == loss for step, loss in resumed), (resumed, losses)
    assert faulted["final_train_loss"] == clean["final_train_loss"] < 3.0  # bytes: log(256) = 5.5 at the start
    checkpoints = [e["step"] for e in events if e["event"] == "checkpoint"]
    assert checkpoints == [20, 40, 60]


def test_the_callback_added_after_the_trainer_was_made_says_how_to_add_it(tmp_path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from kubetrain.integrations.hf import KubetrainCallback

    model = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    data = [{"input_ids": torch.zeros(4, dtype=torch.long), "labels": torch.zeros(4, dtype=torch.long)}] * 4
    trainer = Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), max_steps=1, use_cpu=True,
                                                          report_to=[]), train_dataset=data)
    trainer.add_callback(KubetrainCallback())
    with pytest.raises(RuntimeError, match=r"must be passed to the Trainer when it is made \(Trainer\(\.\.\., "
                                           r"callbacks=\[KubetrainCallback\(\)\]\)\)"):
        trainer.train()
