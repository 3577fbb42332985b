"""DDP communication hooks from `spec.ddp.commHook`, and a count of the bytes each one puts on the wire.

The hooks are torch's own (`torch.distributed.algorithms.ddp_comm_hooks`):
None is the plain averaging all-reduce, FP16 casts each bucket to half
precision, PowerSGD all-reduces the low-rank factors P and Q of every large
enough matrix (with error feedback and warm start) and the rest as is.

The count does not trust the hooks' arithmetic: every hook is handed a
`CountingGroup`, a process group that forwards each all-reduce to the real
one and adds up the bytes of the tensors it was given. So the count is what
the hook actually sent, P and Q included, and the PowerSGD test can check it
against the compression statistics PowerSGDState keeps for itself.

No `from __future__ import annotations` here: DDP checks a hook's `bucket`
annotation against dist.GradBucket itself, and a string would fail that.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

HOOKS = ("None", "FP16", "PowerSGD")

# PowerSGD runs plain all-reduce for its first steps: early gradients are the
# ones low-rank compression hurts most (torch's documentation suggests about
# 10% of the run). With error feedback torch requires at least 2.
POWERSGD_WARMUP_FRACTION = 0.1
POWERSGD_MIN_WARMUP = 2


class CountingGroup(dist.ProcessGroup):
    """A process group that forwards all-reduce to `inner` and counts the payload bytes.

    An all-reduce sends and receives the same number of bytes per rank, a
    fixed multiple of the payload for a given algorithm (2(W-1)/W for a ring),
    so `bytes` is both what this rank sent and what it received, in payload
    terms. Only all-reduce is forwarded: the hooks use nothing else, and any
    other collective fails loudly here instead of going uncounted.
    """

    def __init__(self, inner: dist.ProcessGroup):
        super().__init__(inner.rank(), inner.size())
        self.inner = inner
        self.bytes = 0

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:  # type: ignore[override]  # torch's ProcessGroup.allreduce has overloads
        self.bytes += sum(t.numel() * t.element_size() for t in tensors)
        return self.inner.allreduce(tensors, opts)

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return self.inner.name()


@dataclass
class HookCounts:
    """Gradient bytes so far: raw (the uncompressed buckets) and sent (what the hook all-reduced)."""

    raw_bytes: int = 0
    sent_bytes: int = 0
    compressed_steps: int = 0
    """Steps in which the hook compressed (all of them for FP16; PowerSGD after its warm-up)."""
    compressed_raw_bytes: int = 0
    """raw_bytes of those steps alone."""
    compressed_sent_bytes: int = 0
    """sent_bytes of those steps alone."""


class CommHook:
    """One of torch's hooks, registered on a DDP model, with its traffic counted per step.

    The counts cover this process only: PowerSGD's state (error feedback,
    warm-start factors, iteration) is not checkpointed, so after a restart
    the hook runs its plain all-reduce warm-up again, which is exact.
    """

    def __init__(self, name: str, group: dist.ProcessGroup, *, powersgd_rank: int, total_steps: int, seed: int):
        if name not in HOOKS:
            raise ValueError(f"spec.ddp.commHook: expected one of {', '.join(HOOKS)}, got {name!r}")
        self.name = name
        self.group = CountingGroup(group)
        self.counts = HookCounts()
        self._raw_bytes = 0
        self._compressing_buckets = 0
        self.powersgd: powersgd.PowerSGDState | None = None
        hook: Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]
        if name == "PowerSGD":
            self.powersgd = powersgd.PowerSGDState(
                process_group=self.group,
                matrix_approximation_rank=powersgd_rank,
                start_powerSGD_iter=max(POWERSGD_MIN_WARMUP, int(total_steps * POWERSGD_WARMUP_FRACTION)),
                use_error_feedback=True,
                warm_start=True,
                random_seed=seed,
            )
            self.state: Any = self.powersgd
            hook = powersgd.powerSGD_hook
        else:
            self.state = self.group
            hook = default_hooks.fp16_compress_hook if name == "FP16" else default_hooks.allreduce_hook
        self._hook = hook

    def register(self, model: torch.nn.parallel.DistributedDataParallel) -> None:
        model.register_comm_hook(self.state, self._counted)

    def _counted(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        self._raw_bytes += buffer.numel() * buffer.element_size()
        if self._compresses():
            self._compressing_buckets += 1
        return self._hook(state, bucket)

    def _compresses(self) -> bool:
        if self.name == "PowerSGD":
            assert self.powersgd is not None
            return self.powersgd.iter >= self.powersgd.start_powerSGD_iter
        return self.name == "FP16"

    def end_step(self) -> tuple[int, int]:
        """Account the step just finished; returns its (raw, sent) gradient bytes.

        DDP waits for every bucket's future before backward returns, so by the
        optimizer step all of this step's all-reduces (PowerSGD's P and Q are
        issued from callbacks) have been counted.
        """
        raw, sent = self._raw_bytes, self.group.bytes - self.counts.sent_bytes
        self._raw_bytes = 0
        self.counts.raw_bytes += raw
        self.counts.sent_bytes += sent
        if self._compressing_buckets:
            self.counts.compressed_steps += 1
            self.counts.compressed_raw_bytes += raw
            self.counts.compressed_sent_bytes += sent
            self._compressing_buckets = 0
        return raw, sent

    def stats(self) -> dict[str, Any]:
        """The counts, and for PowerSGD the hook's own compression statistics beside them."""
        out: dict[str, Any] = {"name": self.name, **vars(self.counts)}
        if self.powersgd is not None:
            rate, before, after = self.powersgd.compression_stats()
            out.update(
                powersgd_rank=self.powersgd.matrix_approximation_rank,
                powersgd_start_iter=self.powersgd.start_powerSGD_iter,
                powersgd_numel_before=before,
                powersgd_numel_after=after,
                powersgd_compress_rate=rate,
            )
        return out
