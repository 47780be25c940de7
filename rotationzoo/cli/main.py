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

import typer

from .._version import __version__
from ..errors import RotationZooError

app = typer.Typer(
    name="rotationzoo",
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
) -> None:
    """OSCAR rotations for INT2 KV caches: registry, fetch, verify, kernels, fitting."""


for _name in COMMAND_MODULES:
    importlib.import_module(f".{_name}", __package__).register(app)


def main(argv: list[str] | None = None) -> int:
    """Console entry point: run the app, print library errors as one line, return the exit code."""
    from ._output import print_error

    try:
        rc = app(args=argv, standalone_mode=False)
    except SystemExit as exc:  # pragma: no cover - typer exits
        return int(exc.code or 0)
    except typer.Exit as exc:
        return int(exc.exit_code or 0)
    except typer.Abort:
        print_error("aborted")
        return 130
    except RotationZooError as exc:
        print_error(str(exc))
        return 1
    except KeyboardInterrupt:
        print_error("interrupted")
        return 130
    except Exception as exc:  # click usage errors
        import click

        if isinstance(exc, click.ClickException):
            exc.show()
            return exc.exit_code
        raise
    return int(rc) if isinstance(rc, int) else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
