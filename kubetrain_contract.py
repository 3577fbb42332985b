"""Deprecated: `kubetrain_contract` is kubetrain.shared now, the old name kept for one release (kubetrain/legacy.py)."""

from kubetrain.legacy import alias, run_main

if __name__ == "__main__":
    run_main("kubetrain_contract")
else:
    alias(__name__)
