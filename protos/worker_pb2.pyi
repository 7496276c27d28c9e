import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from headrace.protos import control_pb2 as _control_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WatchLoadRequest(_message.Message):
    __slots__ = ("interval",)
    INTERVAL_FIELD_NUMBER: _ClassVar[int]
    interval: _duration_pb2.Duration
    def __init__(self, interval: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("free_kv_blocks", "total_kv_blocks", "block_size", "running_requests", "waiting_requests", "queued_tokens", "prefix_cache_hit_blocks", "draining", "max_model_len", "admitted_requests", "max_prompt_bytes", "weight_version", "state", "num_ranks")
    FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_RANKS_FIELD_NUMBER: _ClassVar[int]
    free_kv_blocks: int
    total_kv_blocks: int
    block_size: int
    running_requests: int
    waiting_requests: int
    queued_tokens: int
    prefix_cache_hit_blocks: int
    draining: bool
    max_model_len: int
    admitted_requests: int
    max_prompt_bytes: int
    weight_version: str
    state: _control_pb2.GenerationState
    num_ranks: int
    def __init__(self, free_kv_blocks: _Optional[int] = ..., total_kv_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., queued_tokens: _Optional[int] = ..., prefix_cache_hit_blocks: _Optional[int] = ..., draining: _Optional[bool] = ..., max_model_len: _Optional[int] = ..., admitted_requests: _Optional[int] = ..., max_prompt_bytes: _Optional[int] = ..., weight_version: _Optional[str] = ..., state: _Optional[_Union[_control_pb2.GenerationState, str]] = ..., num_ranks: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("grace",)
    GRACE_FIELD_NUMBER: _ClassVar[int]
    grace: _duration_pb2.Duration
    def __init__(self, grace: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("remaining_requests",)
    REMAINING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    remaining_requests: int
    def __init__(self, remaining_requests: _Optional[int] = ...) -> None: ...
