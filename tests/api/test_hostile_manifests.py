"""Manifests built to hurt the reader: each is refused with a message naming the file, exit 2, no traceback.

Every limit here (MAX_MANIFEST_BYTES, MAX_NESTING, int64, finite numbers)
is tested just past its edge; the edge itself still passes.
"""

import pytest

from kubetrain_operator.api.load import MAX_MANIFEST_BYTES, MAX_NESTING
from kubetrain_operator.cli import main

HEAD = b"apiVersion: kubetrain.dev/v1alpha1\nkind: TrainingJob\nmetadata: {name: t}\nspec:\n  mode: Single\n"


def nested(levels: int) -> bytes:
    return HEAD + b"  podTemplate: {metadata: {annotations: {a: " + b"[" * levels + b"]" * levels + b"}}}\n"


def annotation_list(levels: int) -> bytes:
    """A manifest nesting `levels` deep in all: the document, spec, podTemplate, metadata and
    annotations are 5 of them."""
    return nested(levels - 5)


CASES = [
    ("not UTF-8", HEAD + b'  image: "\xff\xfe"\n', "(file)", "is not UTF-8 text: byte 0xff at offset"),
    ("too large", HEAD + b"#" * MAX_MANIFEST_BYTES, "(file)", f"is larger than {MAX_MANIFEST_BYTES} bytes"),
    ("nested too deep", annotation_list(MAX_NESTING + 1), "(file)", f"nests deeper than {MAX_NESTING} levels"),
    ("alias bomb", HEAD + b"  podTemplate:\n    metadata:\n      annotations:\n        a: &a [x, x, x, x]\n"
                          b"        b: &b [*a, *a, *a, *a]\n        c: [*b, *b, *b, *b]\n",
     "(file)", "YAML aliases (*a) are not allowed"),
    ("integer of 5000 digits", HEAD + b"  training: {seed: 1" + b"0" * 5000 + b"}\n", "(file)",
     "a value cannot be read"),
    ("float of 400 digits", HEAD + b"  training: {optimizer: {learningRate: 1" + b"0" * 400 + b".0}}\n",
     "spec.training.optimizer.learningRate", "must be a finite number, got inf"),
    ("NaN", HEAD + b"  training: {optimizer: {learningRate: .nan}}\n", "spec.training.optimizer.learningRate",
     "must be a finite number, got nan"),
    ("infinity", HEAD + b"  dataset: {name: digits, evalFraction: -.inf}\n", "spec.dataset.evalFraction",
     "must be a finite number, got -inf"),
    ("seed past int64", HEAD + b"  training: {seed: 18446744073709551616}\n", "spec.training.seed",
     "must be a 64-bit integer (at most 9223372036854775807)"),
    ("integer of 100 digits", HEAD + b"  training: {batchSize: 1" + b"0" * 100 + b"}\n", "spec.training.batchSize",
     "a number of 101 digits"),
]


@pytest.mark.parametrize("name,text,path,words", CASES, ids=[c[0] for c in CASES])
def test_a_hostile_manifest_is_refused_with_a_message(name, text, path, words, tmp_path, capsys):
    file = tmp_path / "job.yaml"
    file.write_bytes(text)
    assert main(["validate", str(file)]) == 2
    err = capsys.readouterr().err
    assert f"{file}: {path}: " in err and words in err, err
    assert "Traceback" not in err


def test_the_edges_themselves_pass(tmp_path, capsys):
    for text in (annotation_list(MAX_NESTING), HEAD + b"  training: {seed: 9223372036854775807}\n",
                 HEAD + b"  podTemplate:\n    metadata: {labels: &l {a: b}}\n"):  # an anchor without an alias
        file = tmp_path / "job.yaml"
        file.write_bytes(text)
        assert main(["validate", str(file)]) == 0, capsys.readouterr().err
