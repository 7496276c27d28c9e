"""The headrace SDK: clients, generation config, results and typed errors."""

from headrace.sdk.client import AsyncClient, Client
from headrace.sdk.config import GenerationConfig
from headrace.sdk.errors import (
    CancelledError,
    DeadlineExceededError,
    FailedPreconditionError,
    HeadraceError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
)
from headrace.sdk.outputs import (
    Completion,
    FinishReason,
    GenerationResult,
    SampleDelta,
    StreamChunk,
    TokenLogprob,
    Usage,
)
from headrace.sdk.prompts import Chat, ChatMessage, Tool, ToolCall

__all__ = [
    "AsyncClient",
    "CancelledError",
    "Chat",
    "ChatMessage",
    "Client",
    "Completion",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "FinishReason",
    "GenerationConfig",
    "GenerationResult",
    "HeadraceError",
    "InternalError",
    "InvalidArgumentError",
    "NotFoundError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "SampleDelta",
    "StreamChunk",
    "TokenLogprob",
    "Tool",
    "ToolCall",
    "UnauthenticatedError",
    "UnavailableError",
    "Usage",
]
