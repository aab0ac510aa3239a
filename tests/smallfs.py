"""A small file system to fill: a tmpfs of a few MiB mounted on a test's folder."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def small_fs(path: Path, mib: int) -> Iterator[Path]:
    """``path`` as a tmpfs of ``mib`` MiB for the block; skips the test where mounting is
    not permitted (no root, or no CAP_SYS_ADMIN in this container)."""
    path.mkdir(parents=True, exist_ok=True)
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={mib}m,mode=0755", "tmpfs", str(path)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a {mib} MiB tmpfs here: {mount.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(folder: Path) -> Path:
    """A file taking every byte left on ``folder``'s file system."""
    filler = folder / "filler"
    with filler.open("wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    return filler
