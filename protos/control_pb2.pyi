import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PauseMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PAUSE_MODE_UNSPECIFIED: _ClassVar[PauseMode]
    PAUSE_MODE_ABORT: _ClassVar[PauseMode]
    PAUSE_MODE_WAIT: _ClassVar[PauseMode]
    PAUSE_MODE_KEEP: _ClassVar[PauseMode]

class GenerationState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GENERATION_STATE_SERVING: _ClassVar[GenerationState]
    GENERATION_STATE_PAUSED: _ClassVar[GenerationState]
    GENERATION_STATE_ASLEEP: _ClassVar[GenerationState]
    GENERATION_STATE_WEIGHTS_INCOMPLETE: _ClassVar[GenerationState]
PAUSE_MODE_UNSPECIFIED: PauseMode
PAUSE_MODE_ABORT: PauseMode
PAUSE_MODE_WAIT: PauseMode
PAUSE_MODE_KEEP: PauseMode
GENERATION_STATE_SERVING: GenerationState
GENERATION_STATE_PAUSED: GenerationState
GENERATION_STATE_ASLEEP: GenerationState
GENERATION_STATE_WEIGHTS_INCOMPLETE: GenerationState

class PauseGenerationRequest(_message.Message):
    __slots__ = ("mode",)
    MODE_FIELD_NUMBER: _ClassVar[int]
    mode: PauseMode
    def __init__(self, mode: _Optional[_Union[PauseMode, str]] = ...) -> None: ...

class ResumeGenerationRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("version", "path", "staged", "validate_only")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    STAGED_FIELD_NUMBER: _ClassVar[int]
    VALIDATE_ONLY_FIELD_NUMBER: _ClassVar[int]
    version: str
    path: str
    staged: bool
    validate_only: bool
    def __init__(self, version: _Optional[str] = ..., path: _Optional[str] = ..., staged: _Optional[bool] = ..., validate_only: _Optional[bool] = ...) -> None: ...

class WeightsChunk(_message.Message):
    __slots__ = ("version", "stage_only", "name", "dtype", "shape", "offset", "data")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STAGE_ONLY_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    version: str
    stage_only: bool
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    data: bytes
    def __init__(self, version: _Optional[str] = ..., stage_only: _Optional[bool] = ..., name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class DropStagedWeightsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InitWeightsGroupRequest(_message.Message):
    __slots__ = ("host", "port", "world_size", "rank_offset", "backend", "timeout")
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    host: str
    port: int
    world_size: int
    rank_offset: int
    backend: str
    timeout: _duration_pb2.Duration
    def __init__(self, host: _Optional[str] = ..., port: _Optional[int] = ..., world_size: _Optional[int] = ..., rank_offset: _Optional[int] = ..., backend: _Optional[str] = ..., timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class UpdateWeightsFromGroupRequest(_message.Message):
    __slots__ = ("version", "tensors", "validate_only")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    VALIDATE_ONLY_FIELD_NUMBER: _ClassVar[int]
    version: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    validate_only: bool
    def __init__(self, version: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., validate_only: _Optional[bool] = ...) -> None: ...

class SleepRequest(_message.Message):
    __slots__ = ("offload_weights",)
    OFFLOAD_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    offload_weights: bool
    def __init__(self, offload_weights: _Optional[bool] = ...) -> None: ...

class WakeUpRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetWeightVersionRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadLoraAdapterRequest(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class UnloadLoraAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ListLoraAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoraAdapter(_message.Message):
    __slots__ = ("name", "path", "rank")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    rank: int
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., rank: _Optional[int] = ...) -> None: ...

class WorkerState(_message.Message):
    __slots__ = ("worker", "weight_version", "state", "num_ranks", "rank_offset", "lora_adapters")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_RANKS_FIELD_NUMBER: _ClassVar[int]
    RANK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    worker: str
    weight_version: str
    state: GenerationState
    num_ranks: int
    rank_offset: int
    lora_adapters: _containers.RepeatedCompositeFieldContainer[LoraAdapter]
    def __init__(self, worker: _Optional[str] = ..., weight_version: _Optional[str] = ..., state: _Optional[_Union[GenerationState, str]] = ..., num_ranks: _Optional[int] = ..., rank_offset: _Optional[int] = ..., lora_adapters: _Optional[_Iterable[_Union[LoraAdapter, _Mapping]]] = ...) -> None: ...

class ControlResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerState]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerState, _Mapping]]] = ...) -> None: ...
