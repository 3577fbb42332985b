"""The CRD is generated from the API model; the committed copies must not drift."""

from pathlib import Path

from kubetrain_operator.api import crd, schema
from kubetrain_operator.api.spec import Spec

ROOT = Path(__file__).parents[2]


def test_deploy_crd_is_generated_from_the_api_model():
    committed = (ROOT / "deploy/crd/trainingjobs.yaml").read_text()
    assert committed == crd.render(), "run: python -m kubetrain_operator.api.crd > deploy/crd/trainingjobs.yaml"


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
    from kubetrain_operator.api import docs

    committed = (ROOT / "docs/reference.md").read_text()
    assert committed == docs.render(), "run: python -m kubetrain_operator.api.docs > docs/reference.md"
    assert "`spec.parameterServer.compression.algorithm`" in committed


def test_chart_crd_is_the_generated_crd():
    assert (ROOT / "charts/kubetrain/crds/trainingjobs.yaml").read_text() == crd.render()
