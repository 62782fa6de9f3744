"""The command line's parser: no abbreviations, every default in the help, and an error in
one line from the subcommand it belongs to, with a "did you mean" where one is close.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from typing import NoReturn

__all__ = ["HelpFormatter", "Parser", "did_you_mean"]


def did_you_mean(word: str, choices) -> str:
    """ " (did you mean 'x'?)" for the closest of `choices`, or ""."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and epilogs as written; every option's default appended to its help
    unless the help already states it (a flag's default, off, and a None a help explains
    are not repeated)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            action.option_strings
            and "default" not in text.lower()
            and action.default not in (None, False, argparse.SUPPRESS)
            and action.nargs != 0
        ):
            text += " (default: %(default)s)"
        return text


class Parser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` with abbreviations off (`--worker` is not `--workers`), the
    defaults shown, and errors in one line: `netpart train: error: ... (see `netpart train
    --help`)`. Subcommands' parsers are of this class too (argparse makes them so)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self.commands: dict[str, Parser] = {}  # the subcommands' parsers (top level only)

    def error(self, message: str) -> NoReturn:
        message += self._suggestion(message)
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")

    def _suggestion(self, message: str) -> str:
        """A close match for an invalid choice or an unrecognized option, or ""."""
        bad = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if bad:
            return did_you_mean(bad.group(1), re.findall(r"'([^']*)'", bad.group(2)))
        unknown = re.search(r"unrecognized arguments: (\S+)", message)
        if unknown and unknown.group(1).startswith("--"):
            options = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
            return did_you_mean(unknown.group(1).split("=")[0], options)
        return ""

    def parse(self, argv: list[str] | None) -> argparse.Namespace:
        """Parse `argv`; an argument no parser knows is reported by the subcommand it was
        given to, in that subcommand's terms."""
        args, extra = self.parse_known_args(sys.argv[1:] if argv is None else argv)
        if extra:
            owner = self.commands.get(getattr(args, "command", None) or "", self)
            owner.error(f"unrecognized arguments: {' '.join(extra)}")
        return args
