"""format chat and prompt-completion: the answer tokens found from the template's rendering at every turn boundary,
truncation and dropping, packing without cross-talk (a packed batch's per-token loss equals its records' run one by
one), and the loading of JSON Lines and Parquet with the template's sources."""

from __future__ import annotations

import json
import string

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.nn import functional as F

from kubetrain.api.spec import Dataset
from kubetrain.trainer.causal_lm import PAD, CausalLM, load_text
from kubetrain.trainer.conversations import Encoded, answer_samples, encode_chat, encode_pairs, render_chat
from kubetrain.trainer.errors import ConfigError, LoadError
from kubetrain.trainer.objectives import IGNORE_INDEX

SPECIALS = ["<|pad|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""ChatML, as Qwen's and many others' templates render turns."""


def char_tokenizer(template: str | None = TEMPLATE):
    """A tokenizer of one token per character (printable ASCII) and per special token, so that a hand-made
    expectation counts characters."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIALS + list(dict.fromkeys(string.printable)))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(SPECIALS)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<|pad|>", eos_token="<|eos|>")
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


def flags(tokenizer, segments: list[tuple[str, bool]]) -> list[bool]:
    """The per-token expectation of text written as (piece, trained) segments."""
    out: list[bool] = []
    for piece, trained in segments:
        out += [trained] * len(tokenizer(piece, add_special_tokens=False)["input_ids"])
    return out


SYSTEM = {"role": "system", "content": "be brief"}
USER1, ANSWER1 = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}
USER2, ANSWER2 = {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}

CHAT_CASES = [
    pytest.param([USER1, ANSWER1], [("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", False),
                                    ("yo<|im_end|>\n", True)], id="single turn"),
    pytest.param([SYSTEM, USER1, ANSWER1], [("<|im_start|>system\nbe brief<|im_end|>\n", False),
                                            ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", False),
                                            ("yo<|im_end|>\n", True)], id="system prompt"),
    pytest.param([SYSTEM, USER1, ANSWER1, USER2, ANSWER2],
                 [("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n", False),
                  ("<|im_start|>assistant\n", False), ("yo<|im_end|>\n", True),
                  ("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n", False), ("4<|im_end|>\n", True)],
                 id="multi-turn"),
    pytest.param([USER1, ANSWER1, USER2], [("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", False),
                                           ("yo<|im_end|>\n", True), ("<|im_start|>user\n2+2?<|im_end|>\n", False)],
                 id="ending with a user turn"),
]


@pytest.mark.parametrize(("messages", "expected"), CHAT_CASES)
def test_only_the_assistant_turns_and_their_end_carry_the_loss(messages, expected):
    tokenizer = char_tokenizer()
    [encoded] = encode_chat(tokenizer, [messages], "assistant", batch=4)
    assert encoded.answer.tolist() == flags(tokenizer, expected)
    assert tokenizer.decode(encoded.ids.tolist()) == "".join(piece for piece, _ in expected)


def test_train_on_all_trains_every_token():
    tokenizer = char_tokenizer()
    [encoded] = encode_chat(tokenizer, [[SYSTEM, USER1, ANSWER1]], "all", batch=1)
    assert encoded.answer.all()


def test_conversations_are_tokenized_in_batches_as_one():
    tokenizer = char_tokenizer()
    conversations = [[USER1, ANSWER1], [SYSTEM, USER1, ANSWER1, USER2, ANSWER2], [USER2, ANSWER2]]
    one = encode_chat(tokenizer, conversations, "assistant", batch=1)
    whole = encode_chat(tokenizer, conversations, "assistant", batch=64)
    assert [(e.ids.tolist(), e.answer.tolist()) for e in one] == [(e.ids.tolist(), e.answer.tolist()) for e in whole]


def test_a_template_that_rewrites_earlier_turns_is_refused():
    rewriting = ("{% for m in messages %}{% if loop.last %}[last]{% endif %}{{ m.role }}: {{ m.content }}\n"
                 "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(LoadError, match="record 1: the chat template does not render turn 2"):
        encode_chat(char_tokenizer(rewriting), [[USER1, ANSWER1]], "assistant", batch=1)


def test_a_completion_and_its_end_token_carry_the_loss():
    tokenizer = char_tokenizer()
    [encoded] = encode_pairs(tokenizer, [("Q: 2+2? A:", " 4")], "assistant", batch=8)
    assert encoded.answer.tolist() == flags(tokenizer, [("Q: 2+2? A:", False), (" 4<|eos|>", True)])
    assert tokenizer.decode(encoded.ids.tolist()) == "Q: 2+2? A: 4<|eos|>"
    [everything] = encode_pairs(tokenizer, [("Q: 2+2? A:", " 4")], "all", batch=8)
    assert everything.answer.all()


def record(ids: list[int], answer: str) -> Encoded:
    return Encoded(np.asarray(ids, dtype=np.int32), np.asarray([c == "1" for c in answer]))


def test_unpacked_samples_keep_what_fits_and_drop_a_record_with_no_answer_left():
    records = [record([10, 11, 12, 13, 14, 15], "000111"),  # answer cut by the length: keeps 13
               record([20, 21, 22, 23, 24, 25], "000011"),  # no answer token within 4: dropped
               record([30, 31], "11")]  # the first token is never predicted: 31 only
    x, y, dropped = answer_samples(records, 4, packing=False)
    assert dropped == 1
    assert x.tolist() == [[10, 11, 12, 13], [30, 31, PAD, PAD]]
    assert y.tolist() == [[IGNORE_INDEX] * 3 + [13], [IGNORE_INDEX, 31, IGNORE_INDEX, IGNORE_INDEX]]


def test_a_record_whose_only_answer_is_its_first_token_is_dropped():
    x, _, dropped = answer_samples([record([1, 2, 3], "100")], 8, packing=True)
    assert dropped == 1 and len(x) == 0


def test_packed_samples_hold_whole_records_each_from_position_zero():
    records = [record([10, 11, 12], "011"), record([20, 21], "01"), record([30, 31, 32, 33], "0011"),
               record([40, 41, 42, 43, 44, 45, 46], "0001111")]  # cut to 6, answer and all
    x, y, dropped = answer_samples(records, 6, packing=True)
    assert dropped == 0
    assert x[:, 0].tolist() == [[10, 11, 12, 20, 21, PAD], [30, 31, 32, 33, PAD, PAD], [40, 41, 42, 43, 44, 45]]
    assert x[:, 1].tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 4, 5]]
    i = IGNORE_INDEX
    assert y.tolist() == [[i, 11, 12, i, 21, i], [i, i, 32, 33, i, i], [i, i, i, 43, 44, 45]]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A 2-layer Llama over the character tokenizer, randomly initialised, saved as a pretrained directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("chat-model")
    tokenizer = char_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=256, tie_word_embeddings=False))
    model.save_pretrained(root)
    tokenizer.save_pretrained(root)
    return root


def test_a_packed_batch_computes_each_records_per_token_loss_as_run_alone(tiny_model):
    tokenizer = char_tokenizer()
    conversations = [[USER1, ANSWER1], [SYSTEM, USER1, ANSWER1, USER2, ANSWER2], [USER2, ANSWER2],
                     [{"role": "user", "content": "name three colours"}, {"role": "assistant", "content": "red"}],
                     [USER1, {"role": "assistant", "content": "a longer answer, to fill a row"}]]
    encoded = encode_chat(tokenizer, conversations, "assistant", batch=8)
    model = CausalLM(tiny_model, None, seed=0)
    model.materialize(torch.device("cpu"))
    model.eval()
    x, y, dropped = answer_samples(encoded, 128, packing=True)
    assert dropped == 0 and len(x) < len(encoded)  # several records share a row
    with torch.no_grad():
        packed = per_token_loss(model(torch.from_numpy(x)), torch.from_numpy(y))
        alone = torch.cat([per_token_loss(model(torch.from_numpy(sx)), torch.from_numpy(sy))
                           for e in encoded for sx, sy, _ in [answer_samples([e], len(e.ids), packing=False)]])
        crosstalk = per_token_loss(model(torch.from_numpy(x[:, 0])), torch.from_numpy(y))
    assert packed.shape == alone.shape and len(packed) == sum(int(e.answer[1:].sum()) for e in encoded)
    assert torch.allclose(packed, alone, rtol=0, atol=1e-5), (packed - alone).abs().max()
    assert (crosstalk - alone).abs().max() > 1e-3  # the test can tell: one causal sequence over the row differs


def per_token_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The loss of every trained token, in order."""
    labels = y[:, 1:].reshape(-1)
    losses = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels,
                             ignore_index=IGNORE_INDEX, reduction="none")
    return losses[labels != IGNORE_INDEX]


def chat_dataset(path, **fields) -> Dataset:
    return Dataset(path=str(path), format="chat", sequence_length=64, **{"eval_fraction": 0.25, **fields})


def test_chat_records_load_from_json_lines_and_parquet_alike(tiny_model, tmp_path):
    conversations = [[USER1, ANSWER1], [SYSTEM, USER1, ANSWER1, USER2, ANSWER2], [USER2, ANSWER2],
                     [USER1, {"role": "assistant", "content": "hello there"}]]
    (tmp_path / "jsonl").mkdir()
    (tmp_path / "jsonl" / "chats.jsonl").write_text("".join(json.dumps({"turns": c}) + "\n" for c in conversations))
    (tmp_path / "parquet").mkdir()
    pq.write_table(pa.table({"turns": conversations}), tmp_path / "parquet" / "chats.parquet")
    config = json.loads((tiny_model / "config.json").read_text())
    loaded = [load_text(chat_dataset(tmp_path / kind, messages_column="turns", packing=False), tiny_model, config)
              for kind in ("jsonl", "parquet")]
    for data in loaded:
        assert data.train_x.shape == (3, 64) and data.eval_x.shape == (1, 64)
        trained = data.eval_y[data.eval_y != IGNORE_INDEX].tolist()
        assert char_tokenizer().decode(trained) == "hello there<|im_end|>\n"  # eval counts the answer only
    assert torch.equal(loaded[0].train_x, loaded[1].train_x) and torch.equal(loaded[0].train_y, loaded[1].train_y)
    packed = load_text(chat_dataset(tmp_path / "jsonl", messages_column="turns"), tiny_model, config)
    assert packed.train_x.shape[1:] == (2, 64) and packed.input_shape == (2, 64)


def test_the_template_comes_from_the_manifest_or_chat_template_jinja_else_an_error_names_the_field(tmp_path):
    from transformers import LlamaConfig

    model_dir = tmp_path / "model"
    char_tokenizer(template=None).save_pretrained(model_dir)
    LlamaConfig(vocab_size=200).save_pretrained(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"messages": [USER1, ANSWER1]}) + "\n")
    with pytest.raises(ConfigError, match="spec.dataset.chatTemplate: format chat .* has none"):
        load_text(chat_dataset(data, eval_fraction=0.0), model_dir, config)
    given = load_text(chat_dataset(data, eval_fraction=0.0, chat_template=TEMPLATE), model_dir, config)
    (model_dir / "chat_template.jinja").write_text(TEMPLATE)
    beside = load_text(chat_dataset(data, eval_fraction=0.0), model_dir, config)
    assert torch.equal(given.train_y, beside.train_y) and (given.train_y != IGNORE_INDEX).sum() == 4  # yo<|im_end|>\n


def test_prompt_completion_loads_and_a_bad_record_is_named(tiny_model, tmp_path):
    config = json.loads((tiny_model / "config.json").read_text())
    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps({"q": "2+2=", "a": "4"}) + "\n" + json.dumps({"q": "1+1=", "a": "2"}) + "\n")
    dataset = Dataset(path=str(data), format="prompt-completion", prompt_column="q", completion_column="a",
                      sequence_length=16, eval_fraction=0.0, packing=False)
    loaded = load_text(dataset, tiny_model, config)
    assert char_tokenizer().decode(loaded.train_y[0][loaded.train_y[0] != IGNORE_INDEX].tolist()) == "4<|eos|>"
    data.write_text(json.dumps({"q": "2+2=", "answer": "4"}) + "\n")
    with pytest.raises(LoadError, match=r"line 1: no field 'a' \(dataset.completionColumn\)"):
        load_text(dataset, tiny_model, config)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": ["a", "b"]}]}) + "\n")
    with pytest.raises(LoadError, match="record 1 'messages': turn 1: expected"):
        load_text(chat_dataset(bad), tiny_model, config)
