"""Where the math runs and how reproducibly: device selection, threads and determinism."""

from __future__ import annotations

import os

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
    torch.use_deterministic_algorithms(True, warn_only=True)
    return threads
