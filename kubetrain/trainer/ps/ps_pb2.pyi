from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorPiece(_message.Message):
    __slots__ = ("name", "dtype", "shape", "codec", "total_bytes", "offset", "length", "chunk_index")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    codec: str
    total_bytes: int
    offset: int
    length: int
    chunk_index: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., codec: _Optional[str] = ..., total_bytes: _Optional[int] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., chunk_index: _Optional[int] = ...) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("worker", "incarnation", "worker_step", "base_step", "ps_incarnation", "cursor_json", "loss", "no_gradient", "membership", "world_size")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    WORKER_STEP_FIELD_NUMBER: _ClassVar[int]
    BASE_STEP_FIELD_NUMBER: _ClassVar[int]
    PS_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    CURSOR_JSON_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    NO_GRADIENT_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    worker: int
    incarnation: int
    worker_step: int
    base_step: int
    ps_incarnation: int
    cursor_json: str
    loss: float
    no_gradient: bool
    membership: int
    world_size: int
    def __init__(self, worker: _Optional[int] = ..., incarnation: _Optional[int] = ..., worker_step: _Optional[int] = ..., base_step: _Optional[int] = ..., ps_incarnation: _Optional[int] = ..., cursor_json: _Optional[str] = ..., loss: _Optional[float] = ..., no_gradient: _Optional[bool] = ..., membership: _Optional[int] = ..., world_size: _Optional[int] = ...) -> None: ...

class PullHeader(_message.Message):
    __slots__ = ("step", "ps_incarnation", "done", "copy", "copy_crc32", "membership")
    STEP_FIELD_NUMBER: _ClassVar[int]
    PS_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    COPY_FIELD_NUMBER: _ClassVar[int]
    COPY_CRC32_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_FIELD_NUMBER: _ClassVar[int]
    step: int
    ps_incarnation: int
    done: bool
    copy: int
    copy_crc32: int
    membership: int
    def __init__(self, step: _Optional[int] = ..., ps_incarnation: _Optional[int] = ..., done: _Optional[bool] = ..., copy: _Optional[int] = ..., copy_crc32: _Optional[int] = ..., membership: _Optional[int] = ...) -> None: ...

class Frame(_message.Message):
    __slots__ = ("push", "pull", "pieces", "data")
    PUSH_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    push: PushHeader
    pull: PullHeader
    pieces: _containers.RepeatedCompositeFieldContainer[TensorPiece]
    data: bytes
    def __init__(self, push: _Optional[_Union[PushHeader, _Mapping]] = ..., pull: _Optional[_Union[PullHeader, _Mapping]] = ..., pieces: _Optional[_Iterable[_Union[TensorPiece, _Mapping]]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("worker", "worker_step", "min_step", "ps_incarnation", "final", "copy", "membership", "world_size")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    WORKER_STEP_FIELD_NUMBER: _ClassVar[int]
    MIN_STEP_FIELD_NUMBER: _ClassVar[int]
    PS_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    COPY_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    worker: int
    worker_step: int
    min_step: int
    ps_incarnation: int
    final: bool
    copy: int
    membership: int
    world_size: int
    def __init__(self, worker: _Optional[int] = ..., worker_step: _Optional[int] = ..., min_step: _Optional[int] = ..., ps_incarnation: _Optional[int] = ..., final: _Optional[bool] = ..., copy: _Optional[int] = ..., membership: _Optional[int] = ..., world_size: _Optional[int] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("outcome", "step", "staleness")
    class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        OUTCOME_UNSPECIFIED: _ClassVar[PushReply.Outcome]
        APPLIED: _ClassVar[PushReply.Outcome]
        DUPLICATE: _ClassVar[PushReply.Outcome]
        STALE: _ClassVar[PushReply.Outcome]
        DONE: _ClassVar[PushReply.Outcome]
        SKIPPED: _ClassVar[PushReply.Outcome]
    OUTCOME_UNSPECIFIED: PushReply.Outcome
    APPLIED: PushReply.Outcome
    DUPLICATE: PushReply.Outcome
    STALE: PushReply.Outcome
    DONE: PushReply.Outcome
    SKIPPED: PushReply.Outcome
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    outcome: PushReply.Outcome
    step: int
    staleness: int
    def __init__(self, outcome: _Optional[_Union[PushReply.Outcome, str]] = ..., step: _Optional[int] = ..., staleness: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker", "worker_step", "finished", "seconds_since_contact")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    WORKER_STEP_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_CONTACT_FIELD_NUMBER: _ClassVar[int]
    worker: int
    worker_step: int
    finished: bool
    seconds_since_contact: float
    def __init__(self, worker: _Optional[int] = ..., worker_step: _Optional[int] = ..., finished: _Optional[bool] = ..., seconds_since_contact: _Optional[float] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("replica", "step", "ps_incarnation", "aggregation", "tensors", "workers", "dropped_total", "last_checkpoint_step")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PS_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    AGGREGATION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    replica: str
    step: int
    ps_incarnation: int
    aggregation: str
    tensors: _containers.RepeatedScalarFieldContainer[str]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    dropped_total: int
    last_checkpoint_step: int
    def __init__(self, replica: _Optional[str] = ..., step: _Optional[int] = ..., ps_incarnation: _Optional[int] = ..., aggregation: _Optional[str] = ..., tensors: _Optional[_Iterable[str]] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., dropped_total: _Optional[int] = ..., last_checkpoint_step: _Optional[int] = ...) -> None: ...

class FinishRequest(_message.Message):
    __slots__ = ("worker", "cursor_json", "incarnation")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    CURSOR_JSON_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    worker: int
    cursor_json: str
    incarnation: int
    def __init__(self, worker: _Optional[int] = ..., cursor_json: _Optional[str] = ..., incarnation: _Optional[int] = ...) -> None: ...

class FinishReply(_message.Message):
    __slots__ = ("job_finished",)
    JOB_FINISHED_FIELD_NUMBER: _ClassVar[int]
    job_finished: bool
    def __init__(self, job_finished: _Optional[bool] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("worker", "incarnation", "membership", "world_size")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    worker: int
    incarnation: int
    membership: int
    world_size: int
    def __init__(self, worker: _Optional[int] = ..., incarnation: _Optional[int] = ..., membership: _Optional[int] = ..., world_size: _Optional[int] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("rank", "world_size", "cursor_json", "finished", "membership", "released")
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    CURSOR_JSON_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    rank: int
    world_size: int
    cursor_json: str
    finished: bool
    membership: int
    released: bool
    def __init__(self, rank: _Optional[int] = ..., world_size: _Optional[int] = ..., cursor_json: _Optional[str] = ..., finished: _Optional[bool] = ..., membership: _Optional[int] = ..., released: _Optional[bool] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker", "incarnation", "worker_step")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    WORKER_STEP_FIELD_NUMBER: _ClassVar[int]
    worker: int
    incarnation: int
    worker_step: int
    def __init__(self, worker: _Optional[int] = ..., incarnation: _Optional[int] = ..., worker_step: _Optional[int] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("job_finished",)
    JOB_FINISHED_FIELD_NUMBER: _ClassVar[int]
    job_finished: bool
    def __init__(self, job_finished: _Optional[bool] = ...) -> None: ...

class StandRequest(_message.Message):
    __slots__ = ("worker", "incarnation")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    worker: int
    incarnation: int
    def __init__(self, worker: _Optional[int] = ..., incarnation: _Optional[int] = ...) -> None: ...

class StandReply(_message.Message):
    __slots__ = ("worker", "done")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    worker: int
    done: bool
    def __init__(self, worker: _Optional[int] = ..., done: _Optional[bool] = ...) -> None: ...
