"""The ``kvcouple`` command line: one subcommand group per area.

Each area's module exposes ``register(subparsers)``; heavy imports (torch) happen inside the
command functions, so ``kvcouple --help`` stays fast and works without torch.

Errors: every kvcouple error ends the command with one line on stderr, ``kvcouple COMMAND:
error: ...``, and exit status 2 for input that cannot be used (arguments, files, stores) or 1
for a failure while running (disk full, missing extra, a bug); Ctrl-C exits with 130. No
traceback is printed unless ``--debug`` is given (or ``KVCOUPLE_DEBUG=1`` is set).
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import re
import sys
from typing import Any

# Each area module defines register(subparsers) and adds the commands listed with it. A
# command line that names one of these commands imports only its area (the others pull in
# zarr, the tracer's models and policies: a third of a second before anything is read);
# help, and any other command line, imports every area.
_AREAS = {
    "kvcouple.synth.cli": ("synth",),
    "kvcouple.tracer.cli": ("trace",),
    "kvcouple.analysis.cli": ("plan", "analyze", "info"),
    "kvcouple.demo": ("demo",),
    "kvcouple.prompts.cli": ("prompts",),
    "kvcouple.show": ("show",),
}


def _areas_for(argv: list[str]) -> list[str]:
    """The area modules the command line ``argv`` needs: the named command's own, or all."""
    command = next((a for a in argv if not a.startswith("-")), None)
    if command is None or any(a in ("-h", "--help") for a in argv[: argv.index(command)]):
        return list(_AREAS)
    owners = [name for name, commands in _AREAS.items() if command in commands]
    return owners or list(_AREAS)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions keep their line breaks (examples), lose reST markup (module docstrings
    double as descriptions), and every option's help ends with its default when it has one."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        text = re.sub(r":(?:class|func|mod|meth|attr|data):`~?([^`]+)`", r"\1", text)
        text = re.sub(r"``([^`]+)``", r"\1", text)
        text = re.sub(r"::\n", ":\n", text)
        return super()._fill_text(text, width, indent)

    def _get_help_string(self, action: argparse.Action) -> str:
        help = action.help or ""
        if (
            "%(default)" in help
            or "default" in help.lower()
            or action.default in (None, False, argparse.SUPPRESS)
            or action.required
            or not action.option_strings
        ):
            return help
        return f"{help} (default: %(default)s)"


class ArgumentParser(argparse.ArgumentParser):
    """Every (sub)command formats its help with :class:`HelpFormatter`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["formatter_class"] = HelpFormatter
        super().__init__(*args, **kwargs)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The command-line parser; with ``argv``, only the areas that command line needs."""
    parser = ArgumentParser(
        prog="kvcouple",
        description="Measure what a KV-cache eviction policy does to generation, token by token.",
    )
    from kvcouple import __version__

    parser.add_argument("--version", action="version", version=f"kvcouple {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=ArgumentParser)
    for name in list(_AREAS) if argv is None else _areas_for(argv):
        importlib.import_module(name).register(sub)  # every area ships in the wheel
    return parser


# Exit statuses.
USAGE = 2  # the input cannot be used: arguments, files, stores
FAILURE = 1  # the run failed: disk full, a missing extra, a bug
INTERRUPTED = 130


def describe(e: BaseException) -> tuple[str, int]:
    """One line saying what went wrong, and the exit status."""
    from kvcouple.errors import InternalError, MissingExtraError, StoreError, missing_extra

    if isinstance(e, KeyboardInterrupt):
        return "interrupted (rerun the same command to resume a trace)", INTERRUPTED
    if isinstance(e, MissingExtraError):
        return str(e), FAILURE
    if isinstance(e, ModuleNotFoundError):
        extra = missing_extra(e)
        if extra is not None:
            return str(extra), FAILURE
    if isinstance(e, MemoryError):
        return f"out of memory ({e or 'allocation failed'}): ask for less", FAILURE
    if isinstance(e, InternalError):
        return f"internal error (a bug in kvcouple, please report it): {e}", FAILURE
    if isinstance(e, ValueError | StoreError):
        return str(e), USAGE
    if isinstance(e, OSError):
        where = f" ({e.filename})" if e.filename else ""
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return (
                f"no space left on the device{where}: free some space and rerun the same "
                "command (a trace store resumes where it stopped)"
            ), FAILURE
        reason = e.strerror or str(e)
        if isinstance(e, FileNotFoundError | IsADirectoryError | NotADirectoryError):
            return f"{reason}{where}", USAGE
        return f"{reason}{where}", FAILURE
    return (
        f"internal error (a bug in kvcouple, please report it with --debug): "
        f"{type(e).__name__}: {e}"
    ), FAILURE


def main(argv: list[str] | None = None) -> int:
    try:
        argv = sys.argv[1:] if argv is None else list(argv)
        parser = build_parser(argv)
        args = parser.parse_args(argv)
    except KeyboardInterrupt:
        print("kvcouple: interrupted", file=sys.stderr)
        return INTERRUPTED
    if not getattr(args, "func", None):
        parser.print_help()
        return USAGE
    from kvcouple.errors import DEBUG_ENV, debug_requested

    before = os.environ.get(DEBUG_ENV)
    if args.debug:
        os.environ[DEBUG_ENV] = "1"  # nested commands and the demo's trace processes inherit it
    debug = debug_requested()
    try:
        return int(args.func(args) or 0)
    except Exception as e:
        if debug:
            raise
        message, code = describe(e)
    except KeyboardInterrupt as e:
        if debug:
            raise
        message, code = describe(e)
    finally:
        # --debug is this call's: a caller that runs main() again in-process gets its own setting.
        if before is None:
            os.environ.pop(DEBUG_ENV, None)
        else:
            os.environ[DEBUG_ENV] = before
    sub = [v for k, v in vars(args).items() if k.endswith("_command") and isinstance(v, str)]
    print(f"kvcouple {' '.join([args.command, *sub])}: error: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
