"""How every ``headrace`` command's ``--help`` reads: descriptions and their examples kept as
written (not reflowed into one paragraph), and each option's default shown after its help
when it has a meaningful one."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if default in (None, False, argparse.SUPPRESS, "", []) or "%(default)" in text:
            return text
        if action.option_strings and action.nargs != 0:
            text += " (default: %(default)s)"
        return text
