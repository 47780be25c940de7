"""rotationzoo command line.

Examples::

    rotationzoo list
    rotationzoo info Qwen3-8B --json
    rotationzoo verify k_rotation_qqt_r_h_pbr.pt v_rotation_sst_r_h_pbr.pt --head-dim 128
    rotationzoo fetch --model Qwen3-8B
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import click
import typer
import typer.main

from .._version import __version__
from ..errors import CLIError, RotationZooError
from ._options import Group, use_literal_help

app = typer.Typer(
    name="rotationzoo",
    cls=Group,
    help="OSCAR rotations for INT2 KV caches: registry, fetch, verify, kernels, fitting.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

# Command modules; each defines ``register(app)``. They must not import torch at module level,
# so that light commands (``list``, ``info``) start fast.
COMMAND_MODULES = [
    "registry_cmds",
    "fetch_cmds",
    "publish_cmds",
    "serve_cmds",
    "plan_cmds",
    "fit_cmds",
    "eval_cmds",
]


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"rotationzoo {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version_callback, is_eager=True, help="Print the version and exit."
    ),
    debug: bool = typer.Option(
        False, "--debug", help="Show the full traceback of an error (also ROTATIONZOO_DEBUG=1)."
    ),
) -> None:
    """OSCAR rotations for INT2 KV caches: registry, fetch, verify, kernels, fitting."""
    from ._output import MODE

    if debug:
        MODE.debug = True


for _name in COMMAND_MODULES:
    importlib.import_module(f".{_name}", __package__).register(app)
use_literal_help(app)  # square brackets in help texts are text, not rich markup


def _run(args: list[str]) -> Any:
    """Parse ``args`` and run the command, letting every exception through to :func:`main` (typer's own
    loop would turn Ctrl-C into a silent exit 130, and usage errors into a box)."""
    command = typer.main.get_command(app)
    with command.make_context("rotationzoo", args) as ctx:
        return command.invoke(ctx)


class Terminated(KeyboardInterrupt):
    """SIGTERM (``timeout``, ``kill``, a job scheduler) raised in the command like Ctrl-C, so that its
    ``finally`` blocks run (a capture's temporary K/V folder is removed) before it exits 143."""


def _terminate_as_interrupt() -> Any:
    """Make SIGTERM raise :class:`Terminated` while a command runs (main thread only); the handler before."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum: int, frame: Any) -> None:
        raise Terminated()

    return signal.signal(signal.SIGTERM, handler)


def _empty_argument(args: list[str]) -> str | None:
    """The usage error of an empty argument (``--out ""``, ``--out=``, a positional ``""``: an unset shell
    variable), which would otherwise mean the working folder to every path option; ``None`` when there is none."""
    for i, arg in enumerate(args):
        if arg == "" or (arg.startswith("--") and arg.endswith("=")):
            option = arg[:-1] if arg else (args[i - 1] if i and args[i - 1].startswith("-") else None)
            what = f"{option} is given an empty value" if option else f"argument {i + 1} is empty"
            return f"{what} (an unset shell variable?); give a value (see rotationzoo --help)"
    return None


def _usage_line(exc: click.UsageError) -> str:
    """A usage error as one line: click's message (its lines joined) and where the help is."""
    text = "; ".join(line.strip() for line in exc.format_message().splitlines() if line.strip())
    where = exc.ctx.command_path if exc.ctx is not None else "rotationzoo"
    return f"{text} (see {where} --help)"


def main(argv: list[str] | None = None) -> int:
    """Console entry point: run the app and return the exit code.

    Errors are reported once, here, as one line ``error: …`` on stderr, or as one JSON document
    ``{"error": {"type", "message"}}`` on stdout when ``--json`` is among the arguments (even when
    the command line does not parse, or ``ROTATIONZOO_DEBUG`` is bad): a library error (exit 1), any
    other exception asking for a report (exit 1), a usage error (type ``UsageError``, exit 2), Ctrl-C
    (type ``Interrupted``, exit 130). ``--debug`` or ``ROTATIONZOO_DEBUG=1`` adds the traceback of an
    error. A command group given no command prints its help.
    """
    from ._output import json_in_args, report_exception, report_failure, reset_mode

    args = list(sys.argv[1:] if argv is None else argv)
    previous = _terminate_as_interrupt()
    try:
        reset_mode(json=json_in_args(args))  # before parsing: a failure to parse is JSON too
        empty = _empty_argument(args)
        if empty is not None:
            report_failure("UsageError", empty)
            return 2
        rc = _run(args)
    except SystemExit as exc:  # pragma: no cover - typer exits
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except click.exceptions.Exit as exc:  # typer.Exit, --help, --version
        return int(exc.exit_code or 0)
    except click.Abort:  # a question answered with Ctrl-C or end of input
        report_failure("Aborted", "aborted")
        return 130
    except Terminated:
        report_failure("Terminated", "terminated (SIGTERM)")
        return 143
    except KeyboardInterrupt:
        report_failure("Interrupted", "interrupted")
        return 130
    except click.UsageError as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # a group without a command (click >= 8.2): its help
            exc.show()
            return exc.exit_code
        report_failure("UsageError", _usage_line(exc))
        return exc.exit_code
    except click.ClickException as exc:  # other click errors (none are raised today)
        report_failure(type(exc).__name__, exc.format_message())
        return exc.exit_code
    except RotationZooError as exc:
        report_exception(exc)
        return 2 if isinstance(exc, CLIError) else 1  # a command line the options alone refuse: a usage error
    except BrokenPipeError:  # stdout closed early (``| head``): nothing more to say
        sys.stdout = click.utils.PacifyFlushWrapper(sys.stdout)
        return 1
    except Exception as exc:  # noqa: BLE001 - anything unforeseen: one line, the traceback with --debug
        report_exception(exc, internal=True)
        return 1
    finally:
        if previous is not None:
            import signal

            signal.signal(signal.SIGTERM, previous)
    return int(rc) if isinstance(rc, int) else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
