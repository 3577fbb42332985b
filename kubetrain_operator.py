"""Deprecated: `kubetrain_operator` is kubetrain (api, engine, drivers, client, report) now, the old name kept for one release (kubetrain/legacy.py)."""

from kubetrain.legacy import alias, run_main

if __name__ == "__main__":
    run_main("kubetrain_operator")
else:
    alias(__name__)
