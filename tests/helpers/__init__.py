"""What the test areas share, each concern once (tests/ is on sys.path through tests/conftest.py):

- `helpers.wait`: wait_for, polling until something holds, failing with what was last seen.
- `helpers.net`: free loopback ports.
- `helpers.process`: stopping a process (or its group) politely, then for sure.
- `helpers.kube`: the test cluster (`hack/cluster`), the Cluster handle the fixtures yield, and kubectl
  over a cluster's environment, in a namespace or none.
- `helpers.metrics`: scraping a /metrics endpoint and reading its samples.
- `helpers.prometheus`: a real Prometheus process on loopback and its HTTP API.
- `helpers.jsonl`: reading the replicas' event logs, also while they are being written.

Fixtures stay in the conftest.py files; they build on these.
"""
