"""The model initializer against the real S3 server: a model directory fetched into a cache that may be a pod's
mount point (never removed, only emptied of what an interrupted fetch left), checked, marked ready, and used as
it is by the next start without a download."""

from __future__ import annotations

import pytest

from kubetrain.trainer import pretrained as init
from kubetrain.trainer.errors import LoadError
from kubetrain.trainer.objstore import ObjectURI


def test_a_fetch_empties_the_cache_it_is_given_and_the_next_start_downloads_nothing(tmp_path, pretrained, s3,
                                                                                   bucket, monkeypatch):
    store = s3.store()
    for file in pretrained.sharded.iterdir():
        store.upload(file, ObjectURI(bucket, f"base/{file.name}"))
    for key, value in s3.env.items():
        monkeypatch.setenv(key, value)
    cache = tmp_path / "model"  # stands for a pod's emptyDir mount: it exists before the fetch
    cache.mkdir()
    (cache / "leftover.safetensors.part").write_bytes(b"half a download")
    uri = f"s3://{bucket}/base/"
    checked = init.fetch(uri, cache)
    shards = sorted(p.name for p in pretrained.sharded.glob("model-*.safetensors"))
    assert checked.path == cache and checked.weights == shards and len(shards) > 1
    assert checked.config["model_type"] == "llama"
    assert sorted(p.name for p in cache.iterdir()) == sorted([init.READY_FILE, *(p.name for p in
                                                                               pretrained.sharded.iterdir())])
    fetched: list[str] = []
    monkeypatch.setattr(init, "_fetch_object_store", lambda uri, cache: fetched.append(uri) or {})
    assert init.fetch(uri, cache).weights == checked.weights
    assert fetched == [], "the next start found the cache ready and downloaded nothing"
    # Another source for the same cache is fetched again, not taken for the first.
    with pytest.raises(LoadError):  # the stub fetched nothing: the emptied cache has no config.json
        init.fetch(f"s3://{bucket}/other/", cache)
    assert fetched == [f"s3://{bucket}/other/"]


def test_a_missing_bucket_or_prefix_names_the_uri(tmp_path, s3, bucket, monkeypatch):
    for key, value in s3.env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(LoadError, match=f"s3://{bucket}/nothing/: no objects under this prefix"):
        init.fetch(f"s3://{bucket}/nothing/", tmp_path / "a")
    with pytest.raises(LoadError) as err:
        init.fetch("s3://no-such-bucket-kt/base/", tmp_path / "b")
    assert "s3://no-such-bucket-kt" in str(err.value)
