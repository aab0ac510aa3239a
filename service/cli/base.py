"""What every command of ``trainq`` shares: a failure as one line on stderr with its exit code
(``fail``), the wrapper that turns any error a command meets into one (``cli_errors``), and the
HTTP client the client commands speak through (``make_client``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, ParamSpec, TypeVar

import typer

from service.cli.output import clean
from service.cli.specfile import SpecError

if TYPE_CHECKING:
    from service.cli.client import Client

__all__ = ["cli_errors", "fail", "make_client"]

P = ParamSpec("P")
R = TypeVar("R")


def fail(message: str, code: int) -> typer.Exit:
    """Print one line on stderr; the caller raises the returned Exit."""
    # The message may quote the server (an error's detail): one line, no escapes, whatever.
    typer.echo(f"trainq: error: {clean(message)}", err=True)
    return typer.Exit(code)


def cli_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """Every error a command meets becomes one line on stderr and its exit code."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        from service.cli.client import EXIT_INTERRUPTED, EXIT_UNREACHABLE, ClientError

        try:
            return fn(*args, **kwargs)
        except ClientError as exc:
            raise fail(exc.message, exc.exit_code) from None
        except SpecError as exc:
            raise fail(str(exc), 2) from None
        except (typer.Exit, typer.Abort):
            raise
        except KeyboardInterrupt:
            typer.echo("", err=True)
            raise typer.Exit(EXIT_INTERRUPTED) from None
        except BrokenPipeError:
            raise typer.Exit(0) from None  # `trainq logs ID | head`
        except Exception as exc:  # the last resort: a line, not a traceback
            name = exc.__class__.__name__
            raise fail(f"{name}: {exc}", EXIT_UNREACHABLE if "Timeout" in name else 1) from None

    return wrapper


def make_client() -> Client:
    from service.cli.client import Client

    return Client()
