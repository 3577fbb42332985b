"""Where the math runs and how reproducibly: device selection, threads and determinism."""

from __future__ import annotations

import os
import sys

import torch

from .errors import ConfigError

DEFAULT_THREADS = 1


def select_device(setting: str) -> torch.device:
    """`spec.training.device` to a torch.device: auto takes a visible GPU, cuda insists on one."""
    if setting == "cpu":
        return torch.device("cpu")
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if setting == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                "spec.training.device: cuda asked for, but no GPU is visible to this process "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r}); "
                "use auto or cpu"
            )
        return torch.device("cuda")
    raise ConfigError(f"spec.training.device: expected auto, cpu or cuda, got {setting!r}")


def make_deterministic() -> int:
    """Fix threads (KUBETRAIN_THREADS, default 1) and ask torch for deterministic kernels.

    Resuming from a checkpoint must reach the same parameters as an
    uninterrupted run; a parallel CPU reduction or a nondeterministic CUDA
    kernel would add rounding noise that grows over steps. Returns the threads.
    """
    raw = os.environ.get("KUBETRAIN_THREADS", "")
    try:
        threads = int(raw) if raw else DEFAULT_THREADS
    except ValueError:
        raise ConfigError(f"KUBETRAIN_THREADS: expected a positive integer, got {raw!r}") from None
    if threads < 1:
        raise ConfigError(f"KUBETRAIN_THREADS: expected a positive integer, got {threads}")
    torch.set_num_threads(threads)
    # cuBLAS is deterministic only with a fixed workspace; it reads this before its first call.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # warn_only: a user model with an op lacking a deterministic kernel still trains (with a warning).
    deterministic_kernels()
    return threads


def deterministic_kernels() -> None:
    """torch.use_deterministic_algorithms(True, warn_only=True), without its import of
    torch._inductor.config.

    The public call imports the inductor's config (sympy, mpmath and ~900
    modules) to set one flag for torch.compile: 1-2 s on an idle machine and
    7.6 s on this loaded one (measured), paid by every replica at every start,
    on the way to a restarted replica's first step. kubetrain's loops never
    compile; the flag is still set when the inductor is loaded already (a
    user's plug-in that compiles imports it first). Where the private setter
    is gone (another torch), the public call.
    """
    setter = getattr(torch._C, "_set_deterministic_algorithms", None)
    if setter is None or "torch._inductor.config" in sys.modules:
        torch.use_deterministic_algorithms(True, warn_only=True)
        return
    setter(True, warn_only=True)
