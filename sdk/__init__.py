"""The headrace SDK: generation config, typed errors (clients come with the gRPC issue)."""

from headrace.sdk.config import GenerationConfig
from headrace.sdk.errors import (
    CancelledError,
    DeadlineExceededError,
    HeadraceError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
)

__all__ = [
    "CancelledError",
    "DeadlineExceededError",
    "GenerationConfig",
    "HeadraceError",
    "InternalError",
    "InvalidArgumentError",
    "NotFoundError",
    "ResourceExhaustedError",
    "UnavailableError",
]
