"""make_deterministic asks torch for deterministic kernels without importing the inductor (seconds of every start)."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys, torch
from kubetrain.trainer.device import make_deterministic
assert make_deterministic() == 1
assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
assert "torch._inductor.config" not in sys.modules, "the inductor was imported"
torch.use_deterministic_algorithms(False)
import torch._inductor.config as inductor  # a user's plug-in that compiles loads it first
make_deterministic()
assert torch.are_deterministic_algorithms_enabled() and inductor.deterministic
print("ok")
"""


def test_deterministic_kernels_without_the_inductor_unless_it_is_loaded():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
