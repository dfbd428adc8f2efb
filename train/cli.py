"""What the command-line tools share: absl flag parsing and one-line errors."""

from __future__ import annotations

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
