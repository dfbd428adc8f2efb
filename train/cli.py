"""What the command-line tools share: absl flag parsing and one-line errors."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence

from absl import flags


def parse_flags(prog: str, doc: str, define: Callable[[flags.FlagValues], None],
                argv: Sequence[str]) -> flags.FlagValues | None:
    """Parses `argv` (without the program name) into fresh absl FlagValues.

    Returns:
      the parsed flags, or None after printing the help for --help / -h.

    Raises:
      flags.Error: unknown flag, bad value, missing required flag or a
        positional argument.
    """
    fv = flags.FlagValues()
    define(fv)
    if any(a in ("-h", "--help", "-help", "--helpfull") for a in argv):
        print(f"{doc.strip()}\n\nFlags:\n{fv.get_help()}")
        return None
    rest = fv([prog, *argv])
    if len(rest) > 1:
        raise flags.Error(f"unexpected positional arguments {rest[1:]} (flags are --name=value)")
    return fv


def one_line(err: BaseException) -> str:
    """`err`'s message on one line, for `error: ...` on stderr.

    Wrapped exceptions are unwrapped (ml_collections raises a KeyError around
    the real one), and a KeyError gives its message, not its repr.
    """
    while err.args and isinstance(err.args[0], BaseException):
        err = err.args[0]
    text = str(err.args[0]) if isinstance(err, KeyError) and err.args else str(err)
    return " ".join(text.replace("\\n", "\n").split())


def run_command(prog: str, doc: str, define: Callable[[flags.FlagValues], None],
                run: Callable[[flags.FlagValues], object],
                argv: Sequence[str] | None = None) -> int:
    """Parses `argv` (default sys.argv[1:]) and calls `run(flags)`; returns the exit code.

    Bad flags and the errors a user can cause (OSError, ValueError) print one
    `error: ...` line on stderr and give 1, never a traceback.
    """
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("absl").setLevel(logging.ERROR)  # orbax's read-only notices
    try:
        fv = parse_flags(prog, doc, define, sys.argv[1:] if argv is None else argv)
        if fv is not None:
            run(fv)
    except (flags.Error, OSError, ValueError) as err:
        print(f"error: {one_line(err)}", file=sys.stderr)
        return 1
    return 0


def brief(value):
    """A config value for a message: a long id list (output_ids) as its length and ends."""
    if isinstance(value, list | tuple) and len(value) > 6:
        return f"{len(value)} ids {value[0]}..{value[-1]}"
    return value


def missing_data_file(field: str, path) -> str:
    """The message for a data file (config field `field`) that does not exist."""
    return (f"{field}: {path} does not exist. Set it with --config.data.<field>=PATH "
            "(the Multi30k and tiny shakespeare files are expected in ../shared/data, "
            "see configs/ and the README)")
