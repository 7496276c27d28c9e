"""API key files (`--api-key-file`): who may call a server, parsed once at start.

    # one key per line; attributes after it, in any order; '#' starts a comment
    3f9a0c...e1  name=batch max_priority=5 max_concurrency=32
    77b2d4...9c  name=ops admin

- ``name``: how logs and error messages refer to the key (never the key itself); default
  ``line-N``.
- ``max_priority``: the highest `Request.priority` the key may ask for; a request above it is
  refused with PERMISSION_DENIED. Default: no ceiling.
- ``max_concurrency``: requests the key may have in flight on this server at once, over all
  its calls; one more gets RESOURCE_EXHAUSTED with RetryInfo. Default: no limit.
- ``admin``: the key may make control calls (`WorkerControl.Drain`, and every method not
  known to be a caller's, see `sdk/auth.py`).

A key is at least 16 characters of the bearer-token alphabet (letters, digits, ``-._~+/``,
then optional ``=`` padding), e.g. ``openssl rand -hex 24``. Errors name the file and line,
never the key. Lookups compare SHA-256 digests with `hmac.compare_digest` against every key,
so neither a key's content nor its length shows in the time an answer takes.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass, field
from pathlib import Path

from headrace.sdk.errors import InvalidArgumentError

MIN_KEY_CHARS = 16
_KEY = re.compile(r"[A-Za-z0-9\-._~+/]+=*")
_NAME = re.compile(r"[A-Za-z0-9\-._:@]+")
_INT_ATTRIBUTES = ("max_priority", "max_concurrency")
ATTRIBUTES = ("name", *_INT_ATTRIBUTES, "admin")


@dataclass(frozen=True, slots=True)
class ApiKey:
    """One key and what it may do."""

    #: The bearer token itself; never printed (not in repr, logs or errors).
    secret: str = field(repr=False)
    #: What logs and messages call it.
    name: str
    #: Highest priority it may ask for; None: no ceiling.
    max_priority: int | None = None
    #: Requests in flight at once on one server; None: no limit.
    max_concurrency: int | None = None
    #: May make control calls.
    admin: bool = False
    #: Its line in the key file (0: not from a file), for messages.
    line: int = field(default=0, compare=False)
    #: SHA-256 of the secret: what lookups compare.
    digest: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.secret) < MIN_KEY_CHARS or not _KEY.fullmatch(self.secret):
            raise ValueError(
                f"the key must be at least {MIN_KEY_CHARS} characters of letters, digits "
                "and -._~+/ (then optional '=' padding)"
            )
        if not _NAME.fullmatch(self.name):
            raise ValueError(f"name {self.name!r} must be letters, digits or -._:@")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        object.__setattr__(self, "digest", _digest(self.secret))

    @property
    def has_limits(self) -> bool:
        """Whether its requests need counting or checking one by one."""
        return self.max_priority is not None or self.max_concurrency is not None


@dataclass(frozen=True, slots=True)
class ApiKeys:
    """The keys a server accepts."""

    keys: tuple[ApiKey, ...]
    #: Where they came from (the file), for messages.
    source: str = "<keys>"

    def __post_init__(self) -> None:
        if not self.keys:
            raise InvalidArgumentError("api_key_file", f"{self.source}: holds no key")
        _check_unique(self.keys, self.source)

    @classmethod
    def load(cls, path: Path | str) -> ApiKeys:
        """Read and check a key file; InvalidArgumentError names the file and line."""
        try:
            text = Path(path).read_text()
        except OSError as error:
            raise InvalidArgumentError("api_key_file", f"cannot read {path}: {error}") from None
        return cls.parse(text, str(path))

    @classmethod
    def parse(cls, text: str, source: str = "<keys>") -> ApiKeys:
        keys = []
        for line_number, line in enumerate(text.splitlines(), start=1):
            words = line.split("#", 1)[0].split()
            if words:
                keys.append(_parse_line(words, line_number, source))
        return cls(tuple(keys), source)

    def find(self, secret: str) -> ApiKey | None:
        """The key whose secret this is, or None; every key is compared, in constant time."""
        presented = _digest(secret)
        found = None
        for key in self.keys:
            if hmac.compare_digest(key.digest, presented) and found is None:
                found = key
        return found


def _parse_line(words: list[str], line_number: int, source: str) -> ApiKey:
    secret, *attributes = words
    options: dict[str, object] = {}
    try:
        for attribute in attributes:
            name, has_value, value = attribute.partition("=")
            if name in options:
                raise ValueError(f"{name} is given twice")
            options[name] = _attribute(name, value if has_value else None)
        options.setdefault("name", f"line-{line_number}")
        return ApiKey(secret, **options, line=line_number)  # type: ignore[arg-type]
    except ValueError as error:
        raise InvalidArgumentError("api_key_file", f"{source}:{line_number}: {error}") from None


def _attribute(name: str, value: str | None) -> object:
    if name not in ATTRIBUTES:
        raise ValueError(f"unknown attribute {name!r} (known: {', '.join(ATTRIBUTES)})")
    if name == "admin":
        if value is not None:
            raise ValueError("admin takes no value")
        return True
    if not value:
        raise ValueError(f"{name} needs a value ({name}=...)")
    if name in _INT_ATTRIBUTES:
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{name} must be an integer, got {value!r}") from None
    return value


def _check_unique(keys: tuple[ApiKey, ...], source: str) -> None:
    by_digest: dict[bytes, ApiKey] = {}
    by_name: dict[str, ApiKey] = {}
    for key in keys:
        where = f"{source}:{key.line}" if key.line else source
        if (first := by_digest.get(key.digest)) is not None:
            message = f"{where}: the same key as {first.name!r} (line {first.line})"
            raise InvalidArgumentError("api_key_file", message)
        if (first := by_name.get(key.name)) is not None:
            message = f"{where}: name {key.name!r} is already used (line {first.line})"
            raise InvalidArgumentError("api_key_file", message)
        by_digest[key.digest] = by_name[key.name] = key


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()
