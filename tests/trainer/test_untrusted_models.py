"""A pretrained model directory is untrusted input (issue 52): its index, SHA256SUMS and safetensors headers are
read, bounded and confined to the directory, and a bucket's odd keys do not break a fetch."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kubetrain.shared.launch import MODEL_MAX_BYTES_VAR
from kubetrain.trainer import pretrained as init
from kubetrain.trainer.errors import LoadError
from kubetrain.trainer.objstore import ObjectURI


def model_dir(path: Path, sharded: bool = False) -> Path:
    """A minimal Hugging Face directory: a config and one (or two, with an index) safetensors files."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    if sharded:
        save_file({"a": torch.zeros(4)}, str(path / "model-00001-of-00002.safetensors"))
        save_file({"b": torch.ones(4)}, str(path / "model-00002-of-00002.safetensors"))
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
            "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    else:
        save_file({"a": torch.zeros(4)}, str(path / "model.safetensors"))
    return path


def test_an_index_naming_an_absolute_safetensors_path_reads_nothing_outside(tmp_path):
    outside = model_dir(tmp_path / "elsewhere")
    model = model_dir(tmp_path / "model", sharded=True)
    index = {"weight_map": {"a": str(outside / "model.safetensors"), "b": "model-00002-of-00002.safetensors"}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(LoadError, match="names a file outside the model directory"):
        init.check(model, "s3://b/model/")


@pytest.mark.parametrize("name", ["../../etc/hostname", "/etc/hostname", "sub/x"])
def test_sha256sums_naming_a_file_outside_hashes_nothing_there(tmp_path, name):
    model = model_dir(tmp_path / "model")
    (model / "SHA256SUMS").write_text(f"{'0' * 64}  {name}\n")
    with pytest.raises(LoadError, match="SHA256SUMS line 1 names a file outside the model directory"):
        init.check(model, "pvc://models/m")


def test_a_link_in_the_directory_leading_out_is_refused(tmp_path):
    outside = model_dir(tmp_path / "elsewhere")
    model = model_dir(tmp_path / "model", sharded=True)
    (model / "model-00001-of-00002.safetensors").unlink()
    (model / "model-00001-of-00002.safetensors").symlink_to(outside / "model.safetensors")
    with pytest.raises(LoadError, match="leads outside"):
        init.check(model, "pvc://models/m")


@pytest.mark.parametrize("entry", [{"dtype": "F32", "shape": [4]}, {"data_offsets": [0, "x"]}, "not a dict",
                                   {"dtype": "F32", "shape": [4], "data_offsets": [8, 0]}])
def test_a_malformed_safetensors_header_is_a_named_error(tmp_path, entry):
    model = model_dir(tmp_path / "model")
    header = json.dumps({"a": entry}).encode()
    (model / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(LoadError, match=r"model.safetensors: the safetensors header's entry for 'a' is not a tensor's"):
        init.check(model, "s3://b/model/")


def test_a_folder_key_and_a_key_that_is_not_a_plain_name_are_left_out_of_a_fetch(tmp_path, s3, bucket, monkeypatch):
    for key, value in s3.env.items():
        monkeypatch.setenv(key, value)
    store = s3.store()
    source = model_dir(tmp_path / "source")
    store.put_bytes(ObjectURI(bucket, "models/tiny/"), b"")  # what a console's "create folder" makes
    for file in source.iterdir():
        store.upload(file, ObjectURI(bucket, f"models/tiny/{file.name}"))
    store.put_bytes(ObjectURI(bucket, "models/tiny/odd name!.json"), b"x")
    checked = init.fetch(f"s3://{bucket}/models/tiny/", tmp_path / "cache")
    assert checked.weights == ["model.safetensors"]
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted(
        [init.READY_FILE, "config.json", "model.safetensors"])


def test_a_model_larger_than_its_disk_bound_fails_before_the_download_with_both_sizes(tmp_path, s3, bucket,
                                                                                        monkeypatch):
    for key, value in s3.env.items():
        monkeypatch.setenv(key, value)
    store = s3.store()
    source = model_dir(tmp_path / "source")
    total = 0
    for file in source.iterdir():
        store.upload(file, ObjectURI(bucket, f"big/{file.name}"))
        total += file.stat().st_size
    monkeypatch.setenv(MODEL_MAX_BYTES_VAR, str(total - 1))
    with pytest.raises(LoadError, match=rf"the model is {total} bytes .* more than spec.model.diskSize allows its "
                                        rf"copy \({total - 1} bytes"):
        init.fetch(f"s3://{bucket}/big/", tmp_path / "cache")
    assert not any((tmp_path / "cache").glob("*.safetensors"))
    monkeypatch.setenv(MODEL_MAX_BYTES_VAR, str(total))
    assert init.fetch(f"s3://{bucket}/big/", tmp_path / "cache").weights == ["model.safetensors"]
