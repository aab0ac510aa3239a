"""What a tenant may name by path under the data root: the one rule every resolver calls.

The data root holds two areas:

- **the shared area**: everything but ``datasets/``, put there by the operator (shards made
  with ``trainq data prepare``, Hugging Face model folders, tokenizers). Any tenant may name
  it by path: ``train.data.path``, ``train.model.path`` (family hf), ``train.init.path``,
  the upload's ``?tokenizer=``.
- **``datasets/``**: uploaded datasets, ``datasets/<owner key>/<name>/``. No path a tenant
  writes may name anything in it, their own uploads included: a job reaches its owner's
  upload only through ``train.data.dataset: NAME``, which the service resolves for the
  submitting owner and freezes as ``data.path: datasets/<owner key>/NAME`` beside the name.
  The worker checks that frozen path against the job's owner again (`resolve_under` with
  ``dataset`` and ``owner``), so the owner key is the only way in and only its owner holds it.

A tenant's path is a plain relative path: parts joined by single ``/``, none empty, ``.`` or
``..``, not absolute, not starting with ``datasets``, and no part of it, from the root down,
a symbolic link (a link in the shared area could point anywhere, ``datasets/`` included).
The trainer checks again where it opens files, without following links (``trainer.files``).
Messages name the field and the path as the tenant wrote it, never the root's absolute path.

Standard library only: the API, the worker and the trainer all import it.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from pathlib import Path

__all__ = [
    "DATASETS_AREA",
    "PathRefused",
    "dataset_folder",
    "owner_key",
    "resolve_under",
]

DATASETS_AREA = "datasets"  # uploaded datasets: never nameable by a path
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,31}-[0-9a-f]{12}")


class PathRefused(ValueError):
    """A path a tenant may not name; the message names the field, never the root."""


def owner_key(owner: str) -> str:
    """The owner's folder name under ``datasets/``: its safe characters (at most 32), then 12
    hex digits of the sha256 of all of it, so no owner string names a path on its own."""
    slug = re.sub(r"\.{2,}", ".", _UNSAFE.sub("_", owner))[:32].lstrip("._-") or "owner"
    return f"{slug}-{hashlib.sha256(owner.encode()).hexdigest()[:12]}"


def dataset_folder(owner: str, name: str) -> str:
    """An uploaded dataset's folder relative to the data root (what ``data.path`` is frozen
    to at submit)."""
    return f"{DATASETS_AREA}/{owner_key(owner)}/{name}"


def _parts(path: str, field: str) -> list[str]:
    if "\x00" in path:  # no file system takes it (and os.lstat raises ValueError)
        raise PathRefused(f"{field} must not contain NUL (U+0000) characters")
    if path.startswith("/"):
        raise PathRefused(f"{field} must be relative to the data root, got an absolute path")
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise PathRefused(
            f"{field} {path!r} must be a plain relative path under the data root"
            " (no '..', '.', '//' or trailing '/')"
        )
    return parts


def _frozen_ok(parts: list[str], dataset: str, owner: str | None) -> bool:
    """``datasets/<key>/<dataset>``, the key the owner's when the owner is known."""
    if len(parts) != 3 or parts[2] != dataset:
        return False
    return parts[1] == owner_key(owner) if owner is not None else bool(_KEY.fullmatch(parts[1]))


def resolve_under(
    root: str | os.PathLike[str],
    path: str,
    field: str,
    *,
    dataset: str | None = None,
    owner: str | None = None,
) -> Path:
    """``root/path`` for a path a tenant wrote in ``field``, if the rule allows it (see the
    module's docstring); PathRefused otherwise.

    ``dataset`` (a frozen spec's ``data.dataset``) lets ``data.path`` be that dataset's
    folder, ``datasets/<owner key>/<dataset>`` (the key ``owner``'s when given), and nothing
    else in ``datasets/``. The path need not exist; what exists of it must hold no link.
    """
    parts = _parts(path, field)
    if parts[0] == DATASETS_AREA and (dataset is None or not _frozen_ok(parts, dataset, owner)):
        raise PathRefused(
            f"{field} {path!r}: uploaded datasets are not reachable by a path (not even your"
            " own); name yours with train.data.dataset, or use the shared area of the data root"
        )
    base = Path(root).resolve()
    here = base
    for i, part in enumerate(parts):
        here = here / part
        try:
            mode = os.lstat(here).st_mode
        except FileNotFoundError:
            break  # the rest does not exist (yet): nothing below it to follow
        except OSError as exc:
            raise PathRefused(f"{field} {path!r}: cannot look at it ({exc.strerror})") from None
        if stat.S_ISLNK(mode):
            raise PathRefused(
                f"{field} {path!r}: {'/'.join(parts[: i + 1])} is a symbolic link;"
                " links under the data root are not followed"
            )
    found = base.joinpath(*parts)
    assert found.is_relative_to(base)  # no '..', no link: it cannot leave the root
    return found
