"""The pure parts of fine-tuning: text records to token samples (packed, padded), the step recipe (the learning
rate's warm-up and cosine, micro-batches, bf16), the next-token loss over real tokens only, and the text files
each format reads, with their errors naming the file."""

from __future__ import annotations

import json
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch import nn

from kubetrain.api.spec import Dataset, Optimizer, Training
from kubetrain.trainer.causal_lm import PAD, _records, _text_files, hf_name, token_samples
from kubetrain.trainer.errors import LoadError
from kubetrain.trainer.objectives import IGNORE_INDEX, NEXT_TOKEN
from kubetrain.trainer.training import StepRecipe, compute_gradients, perplexity_of


def test_packing_joins_records_with_an_end_token_and_pads_only_the_last_sample():
    samples = token_samples([[5, 6, 7], [8], [9, 10]], length=4, packing=True, eos=2)
    assert samples.tolist() == [[5, 6, 7, 2], [8, 2, 9, 10], [2, PAD, PAD, PAD]]


def test_without_packing_each_record_is_one_sample_cut_and_padded():
    samples = token_samples([[5, 6, 7, 8, 9], [3]], length=4, packing=False, eos=2)
    assert samples.tolist() == [[5, 6, 7, 8], [3, 2, PAD, PAD]]
    assert token_samples([], 4, packing=True, eos=2).shape == (0, 4)


def test_the_next_token_loss_counts_real_tokens_only():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 7)
    target = torch.tensor([[1, 2, 3, 4], [5, 6, IGNORE_INDEX, IGNORE_INDEX]])
    # Position t predicts token t+1: 3 predictions in the first row, 1 in the second (6 after 5).
    expected = [torch.nn.functional.cross_entropy(logits[0, t], target[0, t + 1]) for t in range(3)]
    expected.append(torch.nn.functional.cross_entropy(logits[1, 0], target[1, 1]))
    total, count = NEXT_TOKEN.eval_sums(logits, target)
    assert count == 4
    assert total == pytest.approx(float(sum(expected)), rel=1e-6)
    assert float(NEXT_TOKEN.loss(logits, target)) == pytest.approx(total / count, rel=1e-6)


def recipe(**optimizer) -> StepRecipe:
    return StepRecipe.of(Training(max_steps=100, optimizer=Optimizer(name="adamw", learning_rate=1.0, **optimizer)))


def test_the_learning_rate_warms_up_linearly_then_follows_the_cosine_to_zero():
    plan = recipe(warmup_steps=10, schedule="cosine")
    assert [plan.rate(s, 100) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert plan.rate(10, 100) == pytest.approx(1.0)
    assert plan.rate(55, 100) == pytest.approx(0.5)
    assert plan.rate(100, 100) == pytest.approx(0.0, abs=1e-12)
    assert plan.rate(150, 100) == pytest.approx(0.0, abs=1e-12), "past the end: no negative or rising rate"
    constant = recipe()
    assert {constant.rate(s, 100) for s in (0, 50, 99)} == {1.0}


def test_micro_batches_give_the_whole_batch_s_gradient():
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    x, y = torch.randn(10, 6), torch.randint(0, 3, (10,))
    compute_gradients(model, x, y)
    whole = [p.grad.clone() for p in model.parameters()]
    # Unequal parts (4, 3, 3): each part's loss weighted by its share of the batch.
    loss = compute_gradients(model, x, y, recipe=StepRecipe(learning_rate=0.1, micro_batches=3))
    for grad, expected in zip((p.grad for p in model.parameters()), whole):
        assert torch.allclose(grad, expected, atol=1e-6)
    assert loss == pytest.approx(float(nn.functional.cross_entropy(model(x), y)), rel=1e-5)


def test_bf16_autocast_computes_close_gradients_and_keeps_float32_weights():
    torch.manual_seed(0)
    model = nn.Linear(16, 4)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    compute_gradients(model, x, y)
    exact = model.weight.grad.clone()
    compute_gradients(model, x, y, recipe=StepRecipe(learning_rate=0.1, bf16=True))
    assert model.weight.dtype == torch.float32 and model.weight.grad.dtype == torch.float32
    assert torch.allclose(model.weight.grad, exact, atol=0.05)
    assert not torch.equal(model.weight.grad, exact), "bf16 autocast ran the matmul in bfloat16"


def test_perplexity_is_exp_of_the_loss_nan_when_unmeasured():
    assert perplexity_of(math.log(42.0)) == pytest.approx(42.0)
    assert math.isnan(perplexity_of(math.nan))
    assert perplexity_of(800.0) == math.inf


def test_checkpoint_names_map_to_the_pretrained_files():
    assert hf_name("hf.model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert hf_name("hf.base_model.model.model.layers.1.self_attn.q_proj.base_layer.weight") == \
        "model.layers.1.self_attn.q_proj.weight"


def test_each_text_format_gives_its_records(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps({"text": "two"}) + "\n")
    pq.write_table(pa.table({"body": ["three", "four"]}), tmp_path / "b.parquet")
    (tmp_path / "c.txt").write_text("five\nstill five")
    (tmp_path / "ignored.csv").write_text("x")
    files = _text_files(Dataset(path=str(tmp_path), format="text"))
    assert [p.name for _, p in files] == ["a.jsonl", "b.parquet", "c.txt"]
    records = [r for name, p in files for r in _records(name, p, "body" if name.endswith(".parquet") else "text")]
    assert records == ["one", "two", "three", "four", "five\nstill five"]


@pytest.mark.parametrize("name,content,words", [
    ("bad.jsonl", '{"text": "ok"}\n{"body": "no text"}\n', "bad.jsonl: line 2: no text field 'text'"),
    ("bad.jsonl", '{"text": "ok"}\nnot json\n', "bad.jsonl: line 2: not JSON"),
    ("bad.txt", b"\xff\xfe", "bad.txt: not UTF-8 text"),
    ("bad.parquet", b"PAR1 not really", "bad.parquet: not a Parquet file with a 'text' column"),
])
def test_a_bad_text_file_is_named(tmp_path, name, content, words):
    path = tmp_path / name
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    with pytest.raises(LoadError) as err:
        list(_records(str(path), path, "text"))
    assert words in str(err.value)


def test_a_directory_without_text_files_and_text_past_the_bound_are_refused(tmp_path, monkeypatch):
    (tmp_path / "x.csv").write_text("a")
    with pytest.raises(LoadError, match="no text files"):
        _text_files(Dataset(path=str(tmp_path), format="text"))
    (tmp_path / "big.txt").write_text("y" * 101)
    monkeypatch.setattr("kubetrain.trainer.causal_lm.MAX_TEXT_BYTES", 100)
    with pytest.raises(LoadError, match="101 bytes of text, more than the 100"):
        _text_files(Dataset(path=str(tmp_path), format="text"))
