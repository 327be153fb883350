"""What every ``creditrl`` subcommand's parser shares: ``--config FILE`` and dotted ``key=value``
overrides before or after the options, and one-line errors."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

from creditrl.utils.errors import USER_ERRORS


class GivenOnce(argparse.Action):
    """An option that may be given once: argparse keeps the last of two silently, and a second
    ``--config`` would drop every key of the first."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None) is not None:
            parser.error(f"{option_string}: given twice ({getattr(namespace, self.dest)!r} and {values!r}); give one "
                         f"(merge the files, or set single keys as key=value)")
        setattr(namespace, self.dest, values)


class HelpOnDemand(argparse.ArgumentParser):
    """A parser whose epilog may be a function, called only when the help is shown: the config reference
    loads every estimator and loss term (torch), which a refused argument or a run need not wait for."""

    def format_help(self) -> str:
        if callable(self.epilog):
            self.epilog = self.epilog()
        return super().format_help()


def config_parser(command: str, help_text: str, description: str,
                  epilog: str | Callable[[], str] = "") -> argparse.ArgumentParser:
    """A subcommand's parser with the config arguments every config-taking command has (``epilog``:
    text, or a function giving it when ``--help`` asks)."""
    parser = HelpOnDemand(prog=f"creditrl {command}", description=description or help_text,
                          epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    parser.add_argument("--config", metavar="FILE", action=GivenOnce,
                        help="YAML config file (or a packaged config's name)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars (e.g. in CI logs)")
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str], *, paths: bool = False) -> argparse.Namespace:
    """``parser``'s arguments, ``key=value`` allowed before or after the options (argparse ends the
    positionals at the first option); ``paths``: plain positionals (a directory) are allowed too."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        dashed = next((item for item in extra if item.startswith("--") and "." in item.split("=", 1)[0]), None)
        if dashed:
            key = dashed.lstrip("-")
            parser.error(f"unrecognized argument {dashed}: config keys take no dashes; write "
                         f"{key if '=' in key else key + '=VALUE'}")
        if any(item.startswith("-") or ("=" not in item and not paths) for item in extra):
            parser.parse_args(argv)  # exits with argparse's own message
        args.overrides = [*args.overrides, *extra]
    return args


def run(command: str, fn: Callable[[], int]) -> int:
    """``fn()``, with a user error printed as one line naming the command (exit status 2), and Ctrl-C
    as one line (130, the shell's convention) after whatever the interrupted work printed."""
    try:
        return int(fn() or 0)
    except USER_ERRORS as err:
        if os.environ.get("CREDITRL_DEBUG"):
            raise
        print(f"creditrl {command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:           # Ctrl-C: what was interrupted says where it stands, no traceback
        if os.environ.get("CREDITRL_DEBUG"):
            raise
        print(f"creditrl {command}: interrupted", file=sys.stderr)
        return 130
