"""The parameter-server runtime (spec.mode: ParameterServer): shards, workers, coordinator, transport.

The roles run `serve.run_ps` (a shard) and `worker.run_worker` / `worker.run_standby`
(trainer/__main__.py imports them when chosen); this package imports nothing
itself, so `python -m kubetrain_trainer.ps.codegen` does not load torch.
"""
