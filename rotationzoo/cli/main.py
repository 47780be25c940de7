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

import click
import typer

from .._version import __version__
from ..errors import RotationZooError
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


def main(argv: list[str] | None = None) -> int:
    """Console entry point: run the app and return the exit code.

    Errors are reported once, here: a library error as one line ``error: …`` (JSON on stdout with
    ``--json``), any other exception as one line asking for a report, usage errors as click shows
    them (exit 2); ``--debug`` or ``ROTATIONZOO_DEBUG=1`` adds the traceback.
    """
    from ._output import print_error, report_exception, reset_mode

    try:
        reset_mode()
        rc = app(args=argv, prog_name="rotationzoo", standalone_mode=False)
    except SystemExit as exc:  # pragma: no cover - typer exits
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except click.exceptions.Exit as exc:  # typer.Exit
        return int(exc.exit_code or 0)
    except click.Abort:
        print_error("aborted")
        return 130
    except click.ClickException as exc:  # usage errors
        exc.show()
        return exc.exit_code
    except RotationZooError as exc:
        report_exception(exc)
        return 1
    except KeyboardInterrupt:
        print_error("interrupted")
        return 130
    except Exception as exc:  # noqa: BLE001 - anything unforeseen: one line, the traceback with --debug
        report_exception(exc, internal=True)
        return 1
    return int(rc) if isinstance(rc, int) else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
