"""python -m transformer_zoo.train --config configs/<recipe>.py --workdir DIR [--config.x=...]

Trains (resuming from DIR if it holds checkpoints), evaluates, decodes
held-out examples and prints the metric.

Errors a user can cause (bad flags, a missing config file, a config value out
of range, a workdir that is a file or not writable, a data file that is
missing, not UTF-8 or has no text, a non-finite loss) print one
`error: <message>` line on stderr and exit with code 1, before training starts
where they can be seen up front. Ctrl-C (SIGINT) during set-up, compilation or
the final decode prints one line and exits with code 130 (during training the
loop saves a checkpoint and stops). Any other exception is a bug and keeps its
traceback.
"""

from transformer_zoo.train.host_memory import restart_with_huge_pages

# Before numpy or jax are imported: on CPU, restarts this command once with
# glibc's huge-page tunable, so XLA's per-step buffers are not faulted in 4 KiB
# at a time (train/host_memory.py).
restart_with_huge_pages()

import _thread  # noqa: E402
import asyncio  # noqa: E402
import codecs  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
from pathlib import Path  # noqa: E402

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from transformer_zoo.train.cli import missing_data_file, one_line  # noqa: E402

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Recipe file (configs/*.py).", lock_config=True)
flags.DEFINE_string("workdir", None, "Run directory: checkpoints, tokenizer, metrics.")
flags.mark_flags_as_required(["config", "workdir"])

INTERRUPTED = 130  # the shell's code for a command ended by SIGINT
# data fields naming files: the training ones must hold text to train a tokenizer on.
_TRAIN_FILES = ("train_source", "train_target", "path")
_OTHER_FILES = ("eval_source", "eval_target", "test_source", "test_target")


class UserError(Exception):
    """An error of the command's input: printed as one line, exit code 1."""


def fail(message: str, code: int = 1, *, immediately: bool = False):
    """Prints `error: message` on stderr and exits with `code`.

    Logging and the reports of exceptions in other threads are switched off
    first: library threads still winding down (orbax's after a failed save, with
    their asyncio loops) would otherwise print their own end after this line.
    `immediately` skips the interpreter's finalisation (os._exit after flushing).
    """
    logging.disable(logging.CRITICAL)
    threading.excepthook = sys.unraisablehook = lambda _: None
    print(f"error: {message}", file=sys.stderr)
    if immediately:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


_SIGINT_SEEN = threading.Event()


def keep_interrupts() -> None:
    """Makes a Ctrl-C count wherever it lands, and records that one arrived.

    Python prints "Exception ignored" and drops an exception raised in a callback
    (jax's gc hook, an import lock's), so the KeyboardInterrupt of the SIGINT
    handler would be lost and the run go on; this raises it again in the main code
    instead. And a Ctrl-C can surface as another exception: numpy's C extensions,
    cut short while importing, print the KeyboardInterrupt (through sys.excepthook)
    and raise ImportError("numpy._core.multiarray failed to import") in its place;
    jax re-raises one that lands in a pytree comparison as a ValueError. So the
    SIGINT handler records each Ctrl-C (`interrupted`) and the hook prints none.
    """
    previous = sys.unraisablehook

    def hook(unraisable):
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            # SIGINT's handler again, soon: not here, where it would be dropped too.
            timer = threading.Timer(0.02, _thread.interrupt_main)
            timer.daemon = True
            timer.start()
        else:
            previous(unraisable)

    sys.unraisablehook = hook
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not ignored
        signal.signal(signal.SIGINT, _record_interrupt)
    previous_excepthook = sys.excepthook

    def excepthook(kind, value, traceback):
        if not issubclass(kind, KeyboardInterrupt):
            previous_excepthook(kind, value, traceback)

    sys.excepthook = excepthook


def _record_interrupt(signum, frame):
    _SIGINT_SEEN.set()
    signal.default_int_handler(signum, frame)  # raises KeyboardInterrupt


def interrupted(err: BaseException) -> bool:
    """Whether `err` is a Ctrl-C, or an exception raised after one arrived."""
    return isinstance(err, KeyboardInterrupt) or _SIGINT_SEEN.is_set()


def _without_traceback(record: logging.LogRecord) -> bool:
    """Keeps a library's log line but not its traceback (orbax logs one for a failed
    background save; the error that stops the run is reported once, as one line)."""
    record.exc_info, record.exc_text, record.stack_info = None, None, None
    return True


class _LateCallbacksDropped(asyncio.DefaultEventLoopPolicy):
    """Event loops that ignore a callback scheduled after they were closed.

    When an orbax save fails (a full disk), orbax closes its asyncio loop while
    TensorStore still has writes in flight; each one that finishes later calls
    back into the closed loop from a TensorStore thread, whose RuntimeError
    ("Event loop is closed") TensorStore prints as a traceback. A closed loop can
    never run the callback, so dropping it loses nothing. The training command
    sets this policy; the library leaves asyncio alone.
    """

    def new_event_loop(self):
        loop = super().new_event_loop()
        schedule = loop.call_soon_threadsafe

        def call_soon_threadsafe(callback, *args, context=None):
            if loop.is_closed():
                return None
            return schedule(callback, *args, context=context)

        loop.call_soon_threadsafe = call_soon_threadsafe
        return loop


def config_file(argv) -> str | None:
    """The file of the --config flag in `argv` (without config_flags' ':params'), if given."""
    for i, arg in enumerate(argv):
        if arg in ("--config", "-config") and i + 1 < len(argv):
            return argv[i + 1].split(":", 1)[0]
        if arg.startswith(("--config=", "-config=")):
            return arg.split("=", 1)[1].split(":", 1)[0]
    return None


def _parse_flags(argv):
    """absl's flag parsing; a misspelt or badly typed --config.* override is one line."""
    path = config_file(argv[1:])
    if path and not Path(path).expanduser().is_file():
        fail(f"config file {path} does not exist" if not Path(path).exists()
             else f"config file {path} is not a file")
    try:
        return FLAGS(argv)
    except (flags.Error, AttributeError, KeyError, TypeError, ValueError) as err:
        fail(f"bad flags: {one_line(err)}")


def check_workdir(workdir: str) -> None:
    """UserError unless `workdir` is (or can be made) a directory this process can write."""
    p = Path(workdir).expanduser()
    if p.exists() and not p.is_dir():
        raise UserError(f"--workdir {workdir} is not a directory")
    existing = next(d for d in (p, *p.parents) if d.exists())
    if not existing.is_dir():
        raise UserError(f"--workdir {workdir}: {existing} is not a directory")
    try:  # a probe, not os.access: root, ACLs and read-only mounts all answer truthfully
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as err:
        raise UserError(f"--workdir {workdir} is not writable ({existing}: "
                        f"{err.strerror or err})") from err


def check_data_files(data) -> None:
    """UserError for a data file that is missing, not a file, not UTF-8 or (training)
    without text. Only the files the run reads count: a test target without a test
    source is not read."""
    for name in (*_TRAIN_FILES, *_OTHER_FILES):
        value = data.get(name)
        if not value or name == "test_target" and not data.get("test_source"):
            continue
        p = Path(value).expanduser()
        if not p.exists():
            raise UserError(missing_data_file(f"data.{name}", p))
        if not p.is_file():
            raise UserError(f"data.{name}: {value} is not a regular file")
        if not _utf8_has_text(p, f"data.{name}") and name in _TRAIN_FILES:
            raise UserError(f"data.{name}: {value} is empty or holds only blank lines; the "
                            "tokenizer and the model need text to train on")


def _utf8_has_text(path: Path, field: str, chunk: int = 1 << 20) -> bool:
    """Whether `path` holds a non-blank character; UserError if it is not UTF-8."""
    decoder, offset, has_text = codecs.getincrementaldecoder("utf-8")(), 0, False
    with path.open("rb") as f:
        while block := f.read(chunk):
            try:
                text = decoder.decode(block)
            except UnicodeDecodeError as err:
                raise UserError(f"{field}: {path} is not valid UTF-8 (byte "
                                f"{offset + err.start}: {err.reason})") from err
            has_text = has_text or not text.isspace() and bool(text)
            offset += len(block)
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError as err:
            raise UserError(f"{field}: {path} is not valid UTF-8 (it ends inside a "
                            "character)") from err
    return has_text


def preflight(config, workdir: str) -> None:
    """Every check that needs no jax work: config values, the workdir, the data files."""
    from transformer_zoo.configs import schema

    try:
        schema.check(config)
    except (TypeError, ValueError) as err:
        raise UserError(one_line(err)) from err
    check_workdir(workdir)
    check_data_files(config.data)


def main(argv):
    del argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", force=True)
    for noisy in ("absl", "jax", "orbax", "tensorstore", "grain"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
        logging.getLogger(noisy).addFilter(_without_traceback)
    try:
        preflight(FLAGS.config, FLAGS.workdir)
        # Imported here, so Ctrl-C while jax loads is the one-line interruption too.
        from transformer_zoo.train.loop import NonFiniteLossError, train_and_evaluate

        try:
            train_and_evaluate(FLAGS.config, FLAGS.workdir)
        except (NonFiniteLossError, ValueError, OSError) as err:
            raise UserError(one_line(err)) from err
    except (KeyboardInterrupt, Exception) as err:
        if interrupted(err):  # first: a library may re-raise a Ctrl-C as a ValueError
            # Immediately: a Ctrl-C that cut a compilation short leaves XLA's threads
            # running it, and finalising the interpreter under them can crash (SIGSEGV
            # after this line). What the run holds (the workdir lock, the checkpointer
            # and its saves) was released while the exception unwound.
            fail("interrupted during set-up, compilation or the final decode; the latest "
                 f"checkpoint in {FLAGS.workdir} is kept", INTERRUPTED, immediately=True)
        if isinstance(err, (UserError, OSError)):  # OSError: a data file unreadable in preflight
            fail(one_line(err))
        raise  # a bug: its traceback


if __name__ == "__main__":
    keep_interrupts()
    asyncio.set_event_loop_policy(_LateCallbacksDropped())
    try:
        app.run(main, flags_parser=_parse_flags)
    except (KeyboardInterrupt, Exception) as err:  # Exception: a bug, or Ctrl-C in an import
        if not interrupted(err):
            raise
        # Nothing to clean up yet; immediately, so no second interrupt while exiting.
        fail("interrupted before the run started; nothing was written", INTERRUPTED,
             immediately=True)
