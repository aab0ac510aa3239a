"""File modes of what trainq writes to shared storage: run folders and prepared datasets.

One policy, group-readable at most: folders 0750, files 0640. Run folders (config, logs,
metrics, checkpoints, TensorBoard files, exports) and datasets live on storage that other
users' jobs share; the group (the service account's, the team's) may read them, nobody else.

The process umask never decides it, in two ways:

- what our own code creates gets its mode set explicitly: folders by `make_dirs`, files by
  `set_mode` on the open descriptor (a temporary file from ``mkstemp`` is 0600, raised to
  0640 before its rename; ``open`` would be 0644 under the common umask 022);
- what other people's code writes into a run folder (torchrun's log files, ``torch.save``,
  the sharded files of torch.distributed.checkpoint, TensorBoard's event files) follows
  the umask of the process that writes it, so those processes run with `UMASK`, which
  turns their default 0666 / 0777 into 0640 / 0750: the trainer sets it first thing
  (``python -m trainer``, ``python -m trainer.export``), and the worker starts torchrun
  with it. `fix_tree` then normalizes torchrun's log folders, which it makes with
  ``mkdtemp`` (0700 whatever the umask).

Standard library only: the worker and the light CLI import it without torch.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

__all__ = [
    "DIR_MODE",
    "FILE_MODE",
    "UMASK",
    "NotPlainFile",
    "first_link",
    "fix_tree",
    "make_dirs",
    "open_dir",
    "open_plain",
    "read_plain",
    "set_mode",
]

DIR_MODE = 0o750
FILE_MODE = 0o640
UMASK = 0o027  # 0o777 & ~UMASK == DIR_MODE, 0o666 & ~UMASK == FILE_MODE


def make_dirs(path: Path) -> Path:
    """``mkdir -p path``; every folder it creates gets DIR_MODE. Folders that already exist
    are left as they are (the runs root or a data root belong to their operator)."""
    missing: list[Path] = []
    p = path
    while not p.is_dir():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=DIR_MODE)
        except FileExistsError:  # made by another process (node, rank) a moment ago
            if not folder.is_dir():
                raise
            continue
        os.chmod(folder, DIR_MODE)  # mkdir's mode is cut by the umask (and only cut)
    return path


def set_mode(fd: int, mode: int = FILE_MODE) -> None:
    """Give an open file its mode, whatever the umask made of it."""
    os.fchmod(fd, mode)


def fix_tree(root: Path) -> None:
    """DIR_MODE and FILE_MODE for everything under ``root`` (itself included), for trees that
    other code wrote with modes of its own. Symlinks are neither followed nor changed."""
    if not root.is_dir() or root.is_symlink():
        return
    os.chmod(root, DIR_MODE)
    for folder, dirs, files in os.walk(root):
        for name in dirs:
            p = os.path.join(folder, name)
            if not os.path.islink(p):
                os.chmod(p, DIR_MODE)
        for name in files:
            p = os.path.join(folder, name)
            if not os.path.islink(p):
                os.chmod(p, FILE_MODE)


# -- reading what a spec leads to, never through a link ----------------------------------
#
# Every file a job's spec leads to (shards, meta.json, tokenizer.json, a model folder's
# files, an init checkpoint) is opened with O_NOFOLLOW, relative to its folder's descriptor
# where there is one, and must be a regular file: a link placed in a folder of the data
# root (by mistake or not) could lead anywhere, another owner's upload included
# (trainer.paths states the rule). Messages name no file's bytes and no absolute path.

_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # a FIFO cannot block


class NotPlainFile(OSError):
    """A symbolic link, or not a regular file (a folder, a FIFO, a device) where a regular
    file was expected. The message is short and names no path: callers add their label."""


def open_dir(path: str | os.PathLike[str]) -> int:
    """A descriptor of the folder ``path``, which must not itself be a link."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(path):
            raise NotPlainFile(errno.ELOOP, "is a symbolic link") from None
        raise


def open_plain(name: str | os.PathLike[str], *, dir_fd: int | None = None) -> int:
    """Open a regular file for reading without following a link (relative to ``dir_fd``)."""
    try:
        fd = os.open(name, _READ, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotPlainFile(errno.ELOOP, "is a symbolic link") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotPlainFile(errno.EINVAL, "is not a regular file")
    return fd


def read_plain(
    name: str | os.PathLike[str], *, dir_fd: int | None = None, limit: int = 1 << 30
) -> bytes:
    """The bytes of a regular file (at most ``limit``), opened as `open_plain` does."""
    fd = open_plain(name, dir_fd=dir_fd)
    with os.fdopen(fd, "rb") as f:
        return f.read(limit)


def first_link(folder: str | os.PathLike[str]) -> str | None:
    """The first symbolic link found in ``folder``'s tree (itself included), relative to
    it; None when it holds none. For folders that other code opens by path (transformers'
    ``from_pretrained``, ``torch.distributed.checkpoint``), checked just before."""
    root = Path(folder)
    if root.is_symlink():
        return "."
    for here, dirs, files in os.walk(root):  # followlinks=False: a link is listed, not entered
        for name in (*dirs, *files):
            p = os.path.join(here, name)
            if os.path.islink(p):
                return os.path.relpath(p, root)
    return None
