"""How every ``headrace`` command's ``--help`` reads: descriptions and their examples kept as
written (not reflowed into one paragraph), and each option's default shown after its help
when it has a meaningful one. Old spellings of renamed options still parse, hidden from the
help, with a warning naming the new one (`DeprecatedAlias`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if default in (None, False, argparse.SUPPRESS, "", []) or "%(default)" in text:
            return text
        if action.option_strings and action.nargs != 0:
            text += " (default: %(default)s)"
        return text


class DeprecatedAlias(argparse.Action):
    """An option's old spelling: it stores into the new option's ``dest`` and warns on stderr
    that ``replaced_by`` is the name now. Not shown in ``--help``."""

    def __init__(
        self, option_strings: Sequence[str], dest: str, *, replaced_by: str, **kwargs: Any
    ) -> None:
        kwargs.update(help=argparse.SUPPRESS, default=argparse.SUPPRESS)
        super().__init__(option_strings, dest, **kwargs)
        self.replaced_by = replaced_by

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        print(
            f"{parser.prog}: warning: {option_string} is deprecated; use {self.replaced_by}",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, values)
