"""Manifests built to hurt the reader: each is refused with a message naming the file, exit 2, no traceback.

Every limit here (MAX_MANIFEST_BYTES, MAX_NESTING, int64, finite numbers)
is tested just past its edge; the edge itself still passes.
"""

import pytest
import yaml

from kubetrain.api.load import MAX_MANIFEST_BYTES, MAX_NESTING
from kubetrain.api.schema import MAX_SHOWN_PROBLEMS
from kubetrain.cli import main

HEAD = b"apiVersion: kubetrain.dev/v1alpha1\nkind: TrainingJob\nmetadata: {name: t}\nspec:\n  mode: Single\n"


def nested(levels: int) -> bytes:
    return HEAD + b"  podTemplate: {spec: {affinity: {a: " + b"[" * levels + b"]" * levels + b"}}}\n"


def annotation_list(levels: int) -> bytes:
    """A manifest nesting `levels` deep in all: the document, spec, podTemplate, its spec and
    affinity are 5 of them."""
    return nested(levels - 5)


CASES = [
    ("not UTF-8", HEAD + b'  image: "\xff\xfe"\n', "(file)", "is not UTF-8 text: byte 0xff at offset"),
    ("too large", HEAD + b"#" * MAX_MANIFEST_BYTES, "(file)", f"is larger than {MAX_MANIFEST_BYTES} bytes"),
    ("nested too deep", annotation_list(MAX_NESTING + 1), "(file)", f"nests deeper than {MAX_NESTING} levels"),
    ("alias bomb", HEAD + b"  podTemplate:\n    metadata:\n      annotations:\n        a: &a [x, x, x, x]\n"
                          b"        b: &b [*a, *a, *a, *a]\n        c: [*b, *b, *b, *b]\n",
     "(file)", "YAML aliases (*a) are not allowed"),
    # Python's own message for it was "Exceeds the limit (4300 digits) for integer string conversion".
    ("integer of 6000 digits", HEAD + b"  training: {seed: 1" + b"0" * 6000 + b"}\n", "spec.training.seed",
     "must be a 64-bit integer (at most 9223372036854775807), got a number of 6001 digits (line 6)"),
    ("integer of 6000 digits in podTemplate", HEAD + b"  podTemplate: {spec: {x: 1" + b"0" * 6000 + b"}}\n",
     "spec.podTemplate.spec.x", "got a number of 6001 digits"),
    ("integer of 400 digits in podTemplate", HEAD + b"  podTemplate: {spec: {x: 1" + b"0" * 400 + b"}}\n",
     "spec.podTemplate.spec.x", "must be a 64-bit integer (at most 9223372036854775807), got a number of 401 digits"),
    ("duplicate key", HEAD + b"  podTemplate:\n    spec:\n      containers:\n      - name: trainer\n"
                             b"        securityContext:\n          privileged: true\n          privileged: false\n",
     "spec.podTemplate.spec.containers[0].securityContext.privileged", "is given twice (lines 11 and 12)"),
    ("duplicate top-level key", HEAD + b"spec: {mode: DDP}\n", "spec", "is given twice (lines 4 and 6)"),
    ("namespace of 300 characters", HEAD.replace(b"{name: t}", b"{name: t, namespace: " + b"a" * 300 + b"}"),
     "metadata.namespace", "must be at most 63 characters, got 300"),
    ("namespace not a DNS label", HEAD.replace(b"{name: t}", b"{name: t, namespace: Team_A}"),
     "metadata.namespace", "'Team_A' is not a valid namespace name"),
    ("labels a list", HEAD.replace(b"{name: t}", b"{name: t, labels: [1, 2]}"),
     "metadata.labels", "must be a map of strings to strings, got list"),
    ("label value a number", HEAD.replace(b"{name: t}", b"{name: t, labels: {team: 1}}"),
     "metadata.labels.team", "must be a string, got integer"),
    ("label key not a name", HEAD.replace(b"{name: t}", b"{name: t, labels: {'a b': x}}"),
     "metadata.labels", "key 'a b': its name must be"),
    ("label value too long", HEAD.replace(b"{name: t}", b"{name: t, labels: {team: " + b"x" * 64 + b"}}"),
     "metadata.labels.team", "is not a valid label value"),
    ("annotations not strings", HEAD.replace(b"{name: t}", b"{name: t, annotations: {a: [1]}}"),
     "metadata.annotations.a", "must be a string, got list"),
    ("a YAML merge key", HEAD + b"  training: {<<: {seed: 1}}\n", "(file)", "YAML merge keys (<<) are not allowed"),
    ("a python tag", HEAD + b"  image: !!python/name:os.system\n", "spec.image", "the YAML tag"),
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


def test_a_flood_of_documents_prints_a_bounded_number_of_problems(tmp_path, capsys):
    # 140,000 empty objects (5 problems each) once printed 700,000 lines.
    file = tmp_path / "many.yaml"
    file.write_text("--- {}\n" * 140_000)
    assert main(["validate", str(file)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == MAX_SHOWN_PROBLEMS + 1, lines[-3:]
    assert lines[0] == f"{file}: document 1: apiVersion: must be kubetrain.dev/v1alpha1, got None"
    assert lines[-1] == f"{file}: ... and {5 * 140_000 - MAX_SHOWN_PROBLEMS} more problems"


def test_a_manifest_is_parsed_once_by_libyaml(tmp_path, monkeypatch, capsys):
    # PyYAML's pure-Python loader, run twice (a shape check, then the load), took 31 s of CPU for a
    # 1 MiB flow list; libyaml's parser, once, builds it in a second or two.
    assert yaml.__with_libyaml__, "PyYAML without libyaml: the loader would be the pure-Python one"
    seen = []
    for name in ("parse", "load", "load_all", "safe_load", "safe_load_all", "compose", "compose_all"):
        original = getattr(yaml, name)
        monkeypatch.setattr(yaml, name, lambda *a, _f=original, _n=name, **k: seen.append(
            (_n, k.get("Loader", a[1] if len(a) > 1 else None))) or _f(*a, **k))
    file = tmp_path / "flow.yaml"
    items = ", ".join(["1"] * 300_000)
    file.write_bytes(HEAD + f"  podTemplate: {{spec: {{x: [{items}]}}}}\n".encode())
    assert file.stat().st_size < MAX_MANIFEST_BYTES
    assert main(["validate", "--no-code-check", str(file)]) == 0, capsys.readouterr().err
    assert seen == [("parse", yaml.CSafeLoader)]


def test_a_spec_as_the_api_server_delivers_it_is_bounded_at_the_same_depth():
    """The operator's path (a dict, not YAML): 64 levels in all pass, 65 are refused naming where,
    without recursion (a thousand levels once raised RecursionError in every round)."""
    from kubetrain.api import InvalidSpec, from_spec_dict

    def spec(levels: int) -> dict:
        value: object = "x"
        for _ in range(levels - 4):  # the document, spec, podTemplate and its spec are 4 of them
            value = {"a": value}
        return {"mode": "Single", "podTemplate": {"spec": {"affinity": value}}}

    from_spec_dict("t", spec(MAX_NESTING))
    for levels in (MAX_NESTING + 1, 5000):
        with pytest.raises(InvalidSpec) as refused:
            from_spec_dict("t", spec(levels))
        (problem,) = refused.value.problems
        assert problem.path.startswith("spec.podTemplate.spec.affinity.a") and \
            problem.message == f"nests deeper than {MAX_NESTING} levels (the limit of a TrainingJob)"
