"""The parameter-server runtime (spec.mode: ParameterServer): shards, workers, coordinator, transport.

The roles run `serve.run_ps` (a shard) and `worker.run_worker` / `worker.run_standby`
(kubetrain/trainer/__main__.py imports them when chosen); this package imports nothing
itself, so `python -m kubetrain.trainer.ps.codegen` does not load torch.
"""
