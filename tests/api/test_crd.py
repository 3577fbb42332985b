"""The CRD is generated from the API model; the committed copies must not drift."""

import json
from pathlib import Path

from kubetrain.api import crd, schema
from kubetrain.api.spec import Spec

ROOT = Path(__file__).parents[2]


def test_deploy_crd_is_generated_from_the_api_model():
    committed = (ROOT / "deploy/crd/trainingjobs.yaml").read_text()
    assert committed == crd.render(), "run: python -m kubetrain.api.crd > deploy/crd/trainingjobs.yaml"


def _walk(cls, props, path):
    for f, info in schema.fields_of(cls):
        name = schema.yaml_name(f)
        assert name in props, f"{path}.{name} missing from the CRD"
        prop = props[name]
        assert prop["description"] == schema.meta_of(f).doc
        if info.kind == "object":
            _walk(info.cls, prop["properties"], f"{path}.{name}")
        elif info.kind == "enum":
            assert prop["enum"] == list(info.choices)


def test_every_field_of_the_model_is_in_the_schema_with_its_docs():
    version = crd.crd()["spec"]["versions"][0]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    _walk(Spec, spec["properties"], "spec")
    assert spec["required"] == ["mode"]


def test_cross_field_rules_become_cel_with_the_validator_messages():
    spec = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    messages = [r["message"] for r in spec["x-kubernetes-validations"]]
    assert "parameterServer may be set only when mode is ParameterServer" in messages
    model = spec["properties"]["model"]
    assert model["x-kubernetes-validations"][0]["message"] == "exactly one of name, entrypoint must be set"
    assert spec["properties"]["mode"]["x-kubernetes-validations"][0]["rule"] == "self == oldSelf"


def test_reference_docs_are_generated_from_the_api_model():
    from kubetrain.api import docs

    committed = (ROOT / "docs/reference.md").read_text()
    assert committed == docs.render(), "run: python -m kubetrain.api.docs > docs/reference.md"
    assert "`spec.parameterServer.compression.algorithm`" in committed


def test_chart_crd_is_the_generated_crd():
    assert (ROOT / "charts/kubetrain/crds/trainingjobs.yaml").read_text() == crd.render()


def _pod_template_schema():
    spec = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return spec["properties"]["podTemplate"]


def _nodes(node, path="podTemplate"):
    yield path, node
    for name, child in node.get("properties", {}).items():
        yield from _nodes(child, f"{path}.{name}")
    if "items" in node:
        yield from _nodes(node["items"], f"{path}[]")


def test_pod_template_keeps_every_unknown_field_and_bounds_every_list():
    # Declared only for the CEL rules: nothing a user writes may be pruned, and
    # the API server refuses a rule over a list without maxItems.
    for path, node in _nodes(_pod_template_schema()):
        if node["type"] == "object" and "additionalProperties" in node:  # a map (labels): every key kept, bounded
            assert isinstance(node.get("maxProperties"), int), path
        elif node["type"] == "object":
            assert node.get("x-kubernetes-preserve-unknown-fields") is True, path
        if node["type"] == "array":
            assert isinstance(node.get("maxItems"), int), path


def test_pod_template_cel_rules_speak_the_validator_messages():
    from kubetrain.api import podtemplate

    pt = _pod_template_schema()["properties"]["spec"]["properties"]
    volume_rules = pt["volumes"]["items"]["properties"]["name"]["x-kubernetes-validations"]
    assert [r["message"] for r in volume_rules] == [podtemplate.volume_message(n) for n in podtemplate.VOLUMES]
    container_rules = pt["containers"]["items"]["x-kubernetes-validations"]
    messages = {r.get("message") for r in container_rules}
    expected = ({podtemplate.mount_name_message(n) for n in podtemplate.VOLUMES}
                | {podtemplate.mount_path_message(p) for p in podtemplate.MOUNTS}
                | {podtemplate.port_message(n) for n in podtemplate.PORTS})
    assert expected <= messages
    # The env rule builds env_message(name) in CEL, around the offending name.
    (env_rule,) = [r for r in container_rules if r["fieldPath"] == ".env"]
    assert env_rule["messageExpression"].endswith(json.dumps("' " + podtemplate.ENV_REASON))
    assert podtemplate.env_message("X") == "'X' " + podtemplate.ENV_REASON
