"""Put scikit-learn's bundled digits into a bucket as 8 .npz shards: the data of examples/s3/job.yaml.

    eval $(hack/objstore up)
    .venv/bin/python examples/s3/put_digits.py [s3://kubetrain-examples/digits/]

Uses the AWS_* variables, as the job does (AWS_ENDPOINT_URL for a store that is not AWS); makes the bucket
when it does not exist. Each shard is an .npz of arrays x (features) and y (labels), as a `path` file is.
"""

import io
import sys

import numpy as np

from kubetrain.trainer.data import digits
from kubetrain.trainer.objstore import ObjectStore, ObjectURI, parse_uri

SHARDS = 8


def main() -> None:
    prefix = parse_uri(sys.argv[1] if len(sys.argv) > 1 else "s3://kubetrain-examples/digits/").prefix()
    store = ObjectStore()
    store.ensure_bucket(ObjectURI(prefix.bucket))
    x, y = digits()
    for i, (xs, ys) in enumerate(zip(np.array_split(x, SHARDS), np.array_split(y, SHARDS))):
        buf = io.BytesIO()
        np.savez(buf, x=xs, y=ys)
        store.put_bytes(prefix.child(f"part-{i:03d}.npz"), buf.getvalue())
    print(f"{SHARDS} shards of {len(x)} digits in {prefix}")


if __name__ == "__main__":
    main()
