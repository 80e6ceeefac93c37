"""The commands: muser-decode (decode.py), muser-sweep (sweep.py), muser-bench (bench.py), muser-model (model.py).

Each is also ``python scripts/NAME.py`` from a checkout, and ``python -m muser_ti.cli.NAME``.

What a user of any command sees when something is wrong is one line on standard error, ``error: ...``,
and exit status 2: a bad option value (argparse's own errors included), a file it cannot use, a backend this
machine does not have (with what would make it available), a config, route or pinned-library refusal.
Ctrl-C prints one line, ``interrupted ...`` (how far the command got), and exits 130, the shell's status for
a process ended by SIGINT (128 + 2): a script running the command tells an interruption from bad input.
A traceback is left only for what is none of these, a bug.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import os
import sys
import urllib.parse
from pathlib import Path

from ..errors import BackendError, ConfigError, EngineError, PinnedUnavailable, PlaneError, RouteError

EXIT_ERROR = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process that SIGINT ended


class CommandError(Exception):
    """A command's own refusal (an option value, a missing optional package): one ``error:`` line, exit 2."""


class Interrupted(Exception):
    """Ctrl-C, caught by a command where it knows how far it got: its message is the one line printed."""


# the project's errors at its public surface (muser_ti/errors.py; SnapshotError is an EngineError), and the
# file errors a path given on the command line can raise
PROJECT_ERRORS = (ConfigError, EngineError, BackendError, PinnedUnavailable, RouteError, PlaneError, CommandError)
FILE_ERRORS = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)


def error_line(exc: BaseException) -> str:
    """The one line a command prints for ``exc``: ``error: `` and the message, its line breaks folded."""
    if isinstance(exc, FILE_ERRORS) and exc.filename is not None:
        text = f"{exc.filename}: {exc.strerror or exc}"
    else:
        text = str(exc) or type(exc).__name__
    return "error: " + " ".join(line.strip() for line in text.splitlines() if line.strip())


def guarded(*more_errors: type[BaseException]):
    """Decorate a command's ``main(argv) -> int``: the project's errors (and ``more_errors``) become one
    ``error:`` line on standard error and status 2; Ctrl-C one ``interrupted`` line and status 130."""

    def wrap(main):
        @functools.wraps(main)
        def guarded_main(argv=None) -> int:
            try:
                return main(argv)
            except Interrupted as exc:
                print(str(exc), file=sys.stderr)
                return EXIT_INTERRUPTED
            except KeyboardInterrupt:
                print("interrupted", file=sys.stderr)
                return EXIT_INTERRUPTED
            except PROJECT_ERRORS + FILE_ERRORS + tuple(more_errors) as exc:
                print(error_line(exc), file=sys.stderr)
                return EXIT_ERROR

        return guarded_main

    return wrap


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's help with every option's default: ``(default: X)`` after its help, unless the help already says
    its default in words (``--capacity``'s "default: the geometry's own" says more than "None")."""

    def _get_help_string(self, action):
        text = action.help or ""
        return text if "default" in text.lower() else super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, whose errors read as the commands' own: one ``error: ...`` line, status 2 (argparse
    prints its usage block, then ``PROG: error: ...``), and whose help shows every option's default."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        self.exit(EXIT_ERROR, f"error: {message} (see {self.prog} --help)\n")


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    return _int_at_least(text, 1)


def nonnegative_int(text: str) -> int:
    """An argparse type: an integer >= 0."""
    return _int_at_least(text, 0)


def positive_int_list(text: str) -> list[int]:
    """An argparse type: comma-separated integers >= 1 (``2048,32768``)."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return [_int_at_least(x, 1, whole=text) for x in items]


def _int_at_least(text: str, low: int, whole: str | None = None) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < low:
        what = f"{text!r} in {whole!r}" if whole not in (None, text) else repr(text)
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {what}")
    return value


def checkout() -> Path | None:
    """The source checkout this package runs from, where it was installed editable (``pip install -e .``): pip's
    direct_url.json says so (PEP 610), and a package folder next to a pyproject.toml and a .git is one too (pip
    may not have recorded it); None for an installed wheel."""
    import importlib.metadata as metadata

    for dist in metadata.distributions(name="muser-ti"):
        try:
            info = json.loads(dist.read_text("direct_url.json") or "{}")
        except (OSError, ValueError):
            continue
        if info.get("dir_info", {}).get("editable") and info.get("url", "").startswith("file://"):
            return Path(urllib.parse.unquote(info["url"][len("file://"):]))
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() and (root / ".git").exists() else None


def install_hint(extra: str) -> str:
    """How to install an extra, as the user installed the package: into the checkout it runs from, or the wheel."""
    root = checkout()
    if root is None:
        return f"pip install 'muser-ti[{extra}]'"
    here = Path.cwd().resolve() == root.resolve()
    return f"pip install -e '.[{extra}]'" + ("" if here else f" in {root}")


def need(module: str, command: str, what: str):
    """Import ``module``, one of the commands' optional dependencies (the ``cli`` extra), or refuse with how
    to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise CommandError(f"{command} needs {module} ({what}), which is not installed: "
                           f"{install_hint('cli')}") from None


@contextlib.contextmanager
def progress_bars(*columns, disable: bool = False, console=None):
    """rich's Progress with these columns, whose bars are cleared when the block raises: the ``error:`` or
    ``interrupted`` line is then the last thing on the screen, not a bar stopped at "decode 0/4"."""
    from rich.progress import Progress

    progress = Progress(*columns, disable=disable, console=console)
    progress.start()
    try:
        yield progress
    except BaseException:
        progress.live.transient = True  # Live.stop then erases the bars (and prints no final frame to a file)
        progress.live.stop()  # not Progress.stop, which ends a file's output with an empty line
        raise
    progress.stop()


@contextlib.contextmanager
def stdout_for_data(enabled: bool = True):
    """While active, everything written to the process's standard output, Taichi's C++ logs and Python
    prints alike, goes to standard error instead; yields a text stream on the real standard output, for
    the machine-readable result alone (``--json``).  Disabled, it yields sys.stdout and moves nothing."""
    if not enabled:
        yield sys.stdout
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    real_stdout = sys.stdout
    sys.stdout = sys.stderr
    data = os.fdopen(os.dup(saved), "w")
    try:
        yield data
    finally:
        data.flush()
        data.close()
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
        sys.stdout = real_stdout
