"""Which trainq instance the admin commands (``trainq db ...``, ``trainq token ...``) act on.

The rule is ``trainq up``'s own (``service.local.embedded.embedded_database_url``):
``TRAINQ_DATABASE_URL`` when it is set, else the SQLite file in the data folder,
``--data-dir`` (default ``.trainq``, the folder ``trainq up`` uses by default). So
``trainq up --data-dir D`` and ``trainq token create --data-dir D --name N`` meet in one
database. A SQLite file that does not exist is no instance: the command says what to set
instead of creating an empty database (``db upgrade`` alone creates one, it is how a store
is made). Every database error is one line naming the database and the fix, never a
SQLAlchemy traceback (``admin_errors``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, ParamSpec, TypeVar

import typer

from service.cli.base import fail
from service.local.embedded import embedded_database_url

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from service.api.core.settings import Settings

__all__ = ["DataDir", "Instance", "NoInstance", "admin_errors", "instance"]

P = ParamSpec("P")
R = TypeVar("R")

DEFAULT_DATA_DIR = Path(".trainq")
WHAT_TO_SET = (
    "pass --data-dir DIR (the folder `trainq up --data-dir DIR` uses) or set "
    "TRAINQ_DATABASE_URL to the instance's database"
)

DataDir = Annotated[
    Path | None,
    typer.Option(
        "--data-dir",
        help="the data folder of the `trainq up` to act on (default .trainq; "
        "TRAINQ_DATABASE_URL, when set, wins, as it does for `trainq up`)",
        show_default=False,
    ),
]


class NoInstance(Exception):
    """No trainq database where the settings point; the message says what to set."""


class Instance:
    """One instance's settings and database URL, chosen as ``trainq up`` chooses them."""

    def __init__(self, settings: Settings, url: str) -> None:
        self.settings = settings
        self.url = url

    @property
    def shown_url(self) -> str:
        """The URL without its password, for messages."""
        from sqlalchemy.engine import make_url

        try:
            return make_url(self.url).render_as_string(hide_password=True)
        except Exception:  # a malformed URL: say it as it was set, minus nothing secret
            return self.url.split("@")[-1]

    @contextmanager
    def errors(self) -> Iterator[None]:
        """A database or driver error inside as NoInstance, one line naming the database."""
        from sqlalchemy.exc import SQLAlchemyError

        try:
            yield
        except (SQLAlchemyError, ImportError) as exc:  # ImportError: a driver not installed
            raise NoInstance(_db_message(exc, self.shown_url)) from exc

    @contextmanager
    def session(self, *, write: bool = False) -> Iterator[Session]:
        """A session on this instance's database (in a transaction when ``write``); the
        engine is disposed after, since a test or a script may call commands many times."""
        from service.api.core.db import make_engine, make_sessionmaker

        with self.errors():
            engine = make_engine(self.settings, self.url)
            try:
                with make_sessionmaker(engine)() as session:
                    if write:
                        with session.begin():
                            yield session
                    else:
                        yield session
            finally:
                engine.dispose()


def instance(data_dir: Path | None, *, create: bool = False) -> Instance:
    """The instance ``trainq up`` (with ``--data-dir data_dir``) would run on; NoInstance
    when its SQLite file does not exist, unless ``create``."""
    from service.api.core.settings import Settings

    settings = Settings()
    explicit = "database_url" in settings.model_fields_set
    folder = (data_dir or DEFAULT_DATA_DIR).expanduser()
    url = settings.database_url if explicit else embedded_database_url(folder.resolve())
    found = Instance(settings, url)
    if create:
        return found
    db_file = _sqlite_file(url)
    if db_file is not None and not db_file.is_file():
        if explicit:
            where = f"TRAINQ_DATABASE_URL names {db_file}, which does not exist"
        elif data_dir is None:
            where = f"no trainq instance here ({folder / 'trainq.db'} does not exist)"
        else:
            where = f"no trainq instance in --data-dir {folder} ({folder / 'trainq.db'} is missing)"
        raise NoInstance(f"{where}; {WHAT_TO_SET}")
    return found


def _sqlite_file(url: str) -> Path | None:
    """The file of a file-backed SQLite URL; None for any other database."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return None
    return Path(parsed.database)


def _db_message(exc: Exception, url: str) -> str:
    """A SQLAlchemy or driver error as the one line a user acts on."""
    orig = getattr(exc, "orig", None) or exc
    first = (str(orig).strip().splitlines() or [exc.__class__.__name__])[0]
    text = first.lower()
    if "no such table" in text or ("relation" in text and "does not exist" in text):
        return (
            f"the database {url} has no trainq tables ({first}); run `trainq db upgrade` "
            "with the same --data-dir or TRAINQ_DATABASE_URL, or point at the instance's database"
        )
    return f"cannot use the database {url}: {first}; {WHAT_TO_SET}"


def admin_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """An admin command's database errors as one line on stderr (exit 2: the settings)."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        from pydantic import ValidationError
        from sqlalchemy.exc import ArgumentError

        try:
            return fn(*args, **kwargs)
        except NoInstance as exc:
            raise fail(str(exc), 2) from None
        except ValidationError as exc:  # a TRAINQ_* variable the settings refuse
            err = exc.errors()[0]
            field = "TRAINQ_" + str(err["loc"][0]).upper() if err.get("loc") else "a setting"
            raise fail(f"{field}: {err['msg']}", 2) from None
        except ArgumentError as exc:
            message = f"TRAINQ_DATABASE_URL is not a database URL ({exc}); {WHAT_TO_SET}"
            raise fail(message, 2) from None

    return wrapper
