"""API key files: attributes parsed into typed keys, every mistake named by file and line (and
never by the key), lookups that find exactly the key presented."""

from __future__ import annotations

from pathlib import Path

import pytest
from headrace.sdk.api_keys import ApiKey, ApiKeys
from headrace.sdk.errors import InvalidArgumentError

BATCH = "batch-key-0123456789abcdef"
OPS = "ops-key-0123456789abcdef=="


def test_attributes_become_typed_fields_and_defaults_fill_the_rest() -> None:
    keys = ApiKeys.parse(
        f"""
        # comments and blank lines are skipped

        {BATCH}  max_priority=5 max_concurrency=32 name=batch   # trailing comment
        {OPS} admin name=ops
        plain-key-0123456789abcdef
        """,
        "keys.txt",
    )
    batch, ops, plain = keys.keys
    assert (batch.name, batch.max_priority, batch.max_concurrency, batch.admin) == (
        "batch", 5, 32, False,
    )  # fmt: skip
    assert (ops.name, ops.admin, ops.has_limits) == ("ops", True, False)
    assert (plain.name, plain.max_priority, plain.max_concurrency) == ("line-6", None, None)
    assert batch.has_limits


def test_find_returns_the_key_presented_and_none_for_others() -> None:
    keys = ApiKeys.parse(f"{BATCH} name=batch\n{OPS} name=ops admin\n")
    found = keys.find(OPS)
    assert found is not None and found.name == "ops"
    assert keys.find(BATCH[:-1]) is None
    assert keys.find(BATCH + "x") is None
    assert keys.find("") is None


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (f"{BATCH} colour=blue", "keys.txt:2: unknown attribute 'colour'"),
        (f"{BATCH} max_priority=high", "keys.txt:2: max_priority must be an integer, got 'high'"),
        (f"{BATCH} max_concurrency=0", "keys.txt:2: max_concurrency must be >= 1, got 0"),
        (f"{BATCH} max_priority", "keys.txt:2: max_priority needs a value"),
        (f"{BATCH} admin=yes", "keys.txt:2: admin takes no value"),
        (f"{BATCH} name=a name=b", "keys.txt:2: name is given twice"),
        ("short-key", "keys.txt:2: the key must be at least 16 characters"),
        ("key-with-a-comma,0123456789", "keys.txt:2: the key must be at least 16 characters"),
        (f"{BATCH} name=x", "keys.txt:2: name 'x' is already used (line 1)"),
        (f"{OPS} name=again", "keys.txt:2: the same key as 'x' (line 1)"),
    ],
)
def test_each_mistake_names_file_and_line_and_never_the_key(line: str, message: str) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        ApiKeys.parse(f"{OPS} name=x\n{line}\n", "keys.txt")
    assert caught.value.field == "api_key_file"
    assert str(caught.value).startswith(f"api_key_file: {message}"), str(caught.value)
    assert BATCH not in str(caught.value) and OPS not in str(caught.value)


def test_a_file_without_keys_or_unreadable_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("# nobody yet\n")
    with pytest.raises(InvalidArgumentError, match="holds no key"):
        ApiKeys.load(empty)
    with pytest.raises(InvalidArgumentError, match="cannot read"):
        ApiKeys.load(tmp_path / "missing.txt")


def test_the_secret_is_not_in_repr() -> None:
    key = ApiKey(BATCH, "batch", max_priority=1)
    assert BATCH not in repr(key) and BATCH not in repr(ApiKeys((key,)))
    assert "batch" in repr(key)
