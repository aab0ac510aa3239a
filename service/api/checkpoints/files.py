"""A job's checkpoints as the API reads them from the runs root (shared with the workers).

    RUNS_ROOT/{job_id}/checkpoints/step-N/   DONE, meta.json, model.pt or dcp/, rng-rank*.pt
                                 step-N/hf/  the Hugging Face folder (trainer.publish)

Only complete checkpoints (DONE present) are listed or served. Two formats per checkpoint:
``native`` (every file of step-N except hf/ and the trainer's half-written .hf-tmp/, what
``python -m trainer.export --checkpoint`` and a resume read) and ``hf`` (the files of
step-N/hf, there when it holds config.json). The API serves files; it never converts.

Nothing here follows a link: every folder is opened relative to its parent's descriptor
with O_NOFOLLOW (the runs root itself belongs to the operator and may be a link), entries
that are not plain files or folders are skipped, and so are names a tar member should not
carry. So whatever a run folder holds, only files inside RUNS_ROOT/{job_id}/checkpoints are
read. Everything here blocks (file system); routes call it on a worker thread.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field
from sqlalchemy import select

from service.api.core.models import METRICS
from service.api.jobs.crud import Reader
from trainer.publish import CONFIG_FILE, HF_DIR, HF_TMP_DIR

__all__ = [
    "DONE",
    "CheckpointList",
    "CheckpointOut",
    "Entry",
    "Format",
    "Found",
    "checkpoint_list",
    "checkpoints_dir",
    "complete_steps",
    "open_format",
    "resolve_step",
    "scan_checkpoints",
]

Format = Literal["native", "hf"]
DONE = "DONE"  # trainer.checkpoint.DONE (that module loads torch)
STEP_DIR = re.compile(r"step-([0-9]{1,10})")
# What a member of the archive may be called: our files' names (DCP's .metadata included).
SAFE_NAME = re.compile(r"[A-Za-z0-9_.+=-]{1,200}")
MAX_DEPTH = 8  # folders below step-N (DCP: one)
MAX_ENTRIES = 100_000  # files and folders of one checkpoint, at most
META_MAX_BYTES = 1 << 20

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO swapped in after the scan does not hang the open; fstat then refuses it.
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


class CheckpointOut(BaseModel):
    step: int
    time: datetime | None = Field(None, description="when the checkpoint was written (UTC)")
    tokens_seen: int | None = None
    loss: float | None = Field(None, description="train loss at this step (null: not reported)")
    val_loss: float | None = Field(None, description="val loss at this step (null: no eval)")
    size_bytes: int = Field(description="the native checkpoint's files")
    hf_size_bytes: int | None = Field(None, description="the Hugging Face folder's files")
    strategy: str | None = None
    world_size: int | None = None
    latest: bool
    formats: list[Format]


class CheckpointList(BaseModel):
    job_id: str
    items: list[CheckpointOut] = Field(description="oldest first")


@dataclass(frozen=True)
class Entry:
    """A file or folder of a format: its path under the format's root, as a tar member."""

    parts: tuple[str, ...]
    is_dir: bool
    size: int
    mtime_ns: int
    ino: int

    @property
    def name(self) -> str:
        return "/".join(self.parts)


def open_dir(name: str, dir_fd: int | None = None) -> int:
    """A folder's descriptor; OSError (ELOOP, ENOTDIR) if ``name`` is a link or no folder."""
    return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)


def open_file(name: str, dir_fd: int) -> int:
    """A plain file's descriptor, opened without following a link; OSError otherwise."""
    fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, f"{name} is not a plain file")
    return fd


def checkpoints_dir(runs_root: Path, job_id: str) -> int | None:
    """RUNS_ROOT/{job_id}/checkpoints as a descriptor, or None (no run yet, or a link)."""
    fds: list[int] = []
    try:
        fds.append(open_dir(str(runs_root)))
        fds.append(open_dir(job_id, fds[-1]))
        return open_dir("checkpoints", fds[-1])
    except OSError:
        return None
    finally:
        for fd in fds:
            os.close(fd)


def complete_steps(ck_fd: int) -> list[int]:
    """The complete checkpoints' steps (a real folder step-N holding a plain DONE)."""
    found = []
    with os.scandir(ck_fd) as entries:
        for e in entries:
            m = STEP_DIR.fullmatch(e.name)
            if m is None or not e.is_dir(follow_symlinks=False):
                continue
            try:
                with _closing(open_dir(e.name, ck_fd)) as step_fd:
                    done = os.stat(DONE, dir_fd=step_fd, follow_symlinks=False)
            except OSError:
                continue  # pruned meanwhile, or not ours to read
            if stat.S_ISREG(done.st_mode):
                found.append(int(m.group(1)))
    return sorted(found)


@contextlib.contextmanager
def _closing(fd: int) -> Iterator[int]:
    try:
        yield fd
    finally:
        os.close(fd)


def resolve_step(ck_fd: int, step: int | None) -> int | None:
    """``step`` if it is a complete checkpoint, the latest one for None; else None."""
    steps = complete_steps(ck_fd)
    if step is None:
        return steps[-1] if steps else None
    return step if step in steps else None


def walk(root_fd: int, skip: frozenset[str] = frozenset()) -> list[Entry]:
    """Every plain file and folder under ``root_fd``, in a fixed order (sorted by name, a
    folder before what it holds); links, devices, FIFOs and odd names are left out, and so
    are top-level names in ``skip``."""
    out: list[Entry] = []

    def visit(fd: int, prefix: tuple[str, ...]) -> None:
        with os.scandir(fd) as it:
            entries = sorted(it, key=lambda e: e.name)
        for e in entries:
            if (not prefix and e.name in skip) or not SAFE_NAME.fullmatch(e.name):
                continue
            if e.name in (".", "..") or len(out) >= MAX_ENTRIES:
                continue
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue  # gone meanwhile
            parts = (*prefix, e.name)
            if stat.S_ISREG(st.st_mode):
                out.append(Entry(parts, False, st.st_size, st.st_mtime_ns, st.st_ino))
            elif stat.S_ISDIR(st.st_mode) and len(parts) <= MAX_DEPTH:
                try:
                    sub = open_dir(e.name, fd)
                except OSError:
                    continue
                out.append(Entry(parts, True, 0, st.st_mtime_ns, st.st_ino))
                with _closing(sub):
                    visit(sub, parts)

    visit(root_fd, ())
    return out


def open_format(ck_fd: int, step: int, fmt: Format) -> tuple[int, list[Entry]] | None:
    """The descriptor of the format's root folder (step-N, or step-N/hf) and its entries;
    None when the checkpoint is gone or, for hf, has no complete Hugging Face folder."""
    try:
        step_fd = open_dir(f"step-{step}", ck_fd)
    except OSError:
        return None
    if fmt == "native":
        return step_fd, walk(step_fd, frozenset({HF_DIR, HF_TMP_DIR}))
    try:
        hf_fd = open_dir(HF_DIR, step_fd)
    except OSError:
        return None
    finally:
        os.close(step_fd)
    try:
        config = os.stat(CONFIG_FILE, dir_fd=hf_fd, follow_symlinks=False)
    except OSError:
        os.close(hf_fd)
        return None
    if not stat.S_ISREG(config.st_mode):
        os.close(hf_fd)
        return None
    return hf_fd, walk(hf_fd)


def _meta(step_fd: int) -> dict[str, Any]:
    try:
        with _closing(open_file("meta.json", step_fd)) as fd:
            raw = os.read(fd, META_MAX_BYTES)
        meta = json.loads(raw)
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def _number(value: Any, kind: type) -> Any:
    return value if isinstance(value, kind) and not isinstance(value, bool) else None


def _losses(session: Reader, job_id: str, steps: list[int]) -> dict[int, dict[str, Any]]:
    """The metric point of each step (a later attempt's point for a step wins)."""
    if not steps:
        return {}
    rows = session.execute(
        select(METRICS.c.step, METRICS.c.data)
        .where(METRICS.c.job_id == job_id, METRICS.c.step.in_(steps))
        .order_by(METRICS.c.step, METRICS.c.attempt)
    )
    return {int(step): data for step, data in rows if isinstance(data, dict)}


@dataclass(frozen=True)
class Found:
    """A complete checkpoint as scanned: its meta.json and the sizes of its formats."""

    step: int
    meta: dict[str, Any]
    size: int
    hf_size: int | None


def scan_checkpoints(runs_root: Path, job_id: str) -> list[Found]:
    """The job's complete checkpoints on disk, oldest first (no run folder yet: none)."""
    ck_fd = checkpoints_dir(runs_root, job_id)
    if ck_fd is None:
        return []
    found: list[Found] = []
    with _closing(ck_fd):
        for step in complete_steps(ck_fd):
            native = open_format(ck_fd, step, "native")
            if native is None:
                continue  # pruned since it was listed
            with _closing(native[0]) as step_fd:
                meta = _meta(step_fd)
            hf = open_format(ck_fd, step, "hf")
            hf_size = None
            if hf is not None:
                os.close(hf[0])
                hf_size = sum(e.size for e in hf[1])
            found.append(Found(step, meta, sum(e.size for e in native[1]), hf_size))
    return found


def checkpoint_list(session: Reader, job_id: str, found: list[Found]) -> CheckpointList:
    """The listing's answer: what was scanned, with the losses SQL has for those steps."""
    points = _losses(session, job_id, [f.step for f in found])
    items = []
    for f in found:
        point, meta = points.get(f.step, {}), f.meta
        written = _number(meta.get("time"), float)
        items.append(
            CheckpointOut(
                step=f.step,
                time=datetime.fromtimestamp(written, UTC) if written is not None else None,
                tokens_seen=_number(meta.get("tokens_seen"), int),
                loss=_number(point.get("loss"), float),
                val_loss=_number(point.get("val_loss"), float),
                size_bytes=f.size,
                hf_size_bytes=f.hf_size,
                strategy=meta.get("strategy") if isinstance(meta.get("strategy"), str) else None,
                world_size=_number(meta.get("world_size"), int),
                latest=f is found[-1],
                formats=["native", "hf"] if f.hf_size is not None else ["native"],
            )
        )
    return CheckpointList(job_id=job_id, items=items)
