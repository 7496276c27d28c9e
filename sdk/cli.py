"""The ``headrace`` command line.

    headrace models list              known model names, whether prepared, and where
    headrace models prepare [NAME]    convert a known model into the cache (once)

Each command group is one ``_add_*`` function in `COMMAND_GROUPS` that adds its subparser
and sets ``handler`` on its leaf commands; `worker`, `router`, `generate` and `up` are added
the same way. Handlers import worker or router modules themselves, so importing this module
(and the SDK) never loads torch.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from headrace.sdk.errors import HeadraceError

Handler = Callable[[argparse.Namespace], int]
# argparse's subparsers object; its class is private, so it is named once here.
SubParsers = argparse._SubParsersAction


def _models_list(args: argparse.Namespace) -> int:
    from headrace.worker.model_store import DEFAULT_MODEL, KNOWN_MODELS, is_prepared, model_dir

    rows = [("NAME", "PREPARED", "PATH")]
    for name in sorted(KNOWN_MODELS):
        path = model_dir(name)
        label = f"{name} (default)" if name == DEFAULT_MODEL else name
        rows.append((label, "yes" if is_prepared(path) else "no", str(path)))
    widths = [max(len(row[column]) for row in rows) for column in range(2)]
    for label, prepared, location in rows:
        print(f"{label:<{widths[0]}}  {prepared:<{widths[1]}}  {location}")
    return 0


def _models_prepare(args: argparse.Namespace) -> int:
    from headrace.worker.model_store import DEFAULT_MODEL, prepare_model

    print(prepare_model(args.name or DEFAULT_MODEL, force=args.force))
    return 0


def _add_models(subparsers: SubParsers) -> None:
    models = subparsers.add_parser("models", help="list and prepare models")
    commands = models.add_subparsers(dest="models_command", metavar="COMMAND", required=True)
    listing = commands.add_parser("list", help="known model names, whether prepared, and where")
    listing.set_defaults(handler=_models_list)
    prepare = commands.add_parser("prepare", help="convert a known model into the cache, once")
    prepare.add_argument("name", nargs="?", help="a known model name (default: the default model)")
    prepare.add_argument("--force", action="store_true", help="prepare again even if done")
    prepare.set_defaults(handler=_models_prepare)


#: One entry per top-level command; later issues append `worker`, `router`, `generate`, `up`.
COMMAND_GROUPS: tuple[Callable[[SubParsers], None], ...] = (_add_models,)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="headrace", description="headrace: serve LLMs over gRPC")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add_group in COMMAND_GROUPS:
        add_group(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler: Handler = args.handler
    try:
        return handler(args)
    except HeadraceError as error:
        print(f"headrace: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
