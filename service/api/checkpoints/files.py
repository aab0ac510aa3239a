"""A job's checkpoints as the API reads them from the runs root (shared with the workers).

    RUNS_ROOT/{job_id}/checkpoints/step-N/   DONE, meta.json, model.pt or dcp/, rng-rank*.pt
                                 step-N/hf/  the Hugging Face folder (trainer.publish)
                                 step-N/peft/  a LoRA run's PEFT adapter (trainer.publish)
                                 step-N/hf.failed.json  {"reason"}: that export failed

Only complete checkpoints (DONE present) are listed or served. Three formats per checkpoint:
``native`` (every file of step-N except the export folders, their half-written temporary
folders and failure markers: what ``python -m trainer.export --checkpoint`` and a resume
read), ``hf`` (the files of step-N/hf, there when it holds config.json) and ``peft`` (the
files of step-N/peft, there when it holds adapter_config.json). An export the trainer was
asked for and could not write is listed as failed with its reason (``FORMAT.failed.json``).
The API serves files; it never converts.

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
from trainer.publish import EXPORT_DIRS, failed_name

__all__ = [
    "DONE",
    "CheckpointList",
    "CheckpointOut",
    "Entry",
    "ExportOut",
    "Format",
    "Found",
    "checkpoint_list",
    "checkpoints_dir",
    "complete_steps",
    "export_failure",
    "open_format",
    "resolve_step",
    "scan_checkpoints",
]

Format = Literal["native", "hf", "peft"]
ExportFormat = Literal["hf", "peft"]
EXPORT_FORMATS: tuple[ExportFormat, ...] = ("hf", "peft")
DONE = "DONE"  # trainer.checkpoint.DONE (that module loads torch)
STEP_DIR = re.compile(r"step-([0-9]{1,10})")
# What a member of the archive may be called: our files' names (DCP's .metadata included).
SAFE_NAME = re.compile(r"[A-Za-z0-9_.+=-]{1,200}")
MAX_DEPTH = 8  # folders below step-N (DCP: one)
MAX_ENTRIES = 100_000  # files and folders of one checkpoint, at most
META_MAX_BYTES = 1 << 20
FAILED_MAX_BYTES = 1 << 16
REASON_MAX_CHARS = 2000
# step-N's names that are not the native checkpoint: the export folders, their temporary
# folders, and the failure markers.
NOT_NATIVE = frozenset(
    {name for folder, tmp, _ in EXPORT_DIRS.values() for name in (folder, tmp)}
    | {failed_name(fmt) for fmt in EXPORT_DIRS}
)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO swapped in after the scan does not hang the open; fstat then refuses it.
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


class ExportOut(BaseModel):
    status: Literal["ready", "failed"] = Field(
        description="ready: downloadable; failed: the trainer was asked for it and could not"
    )
    size_bytes: int | None = Field(None, description="its files (ready)")
    reason: str | None = Field(None, description="why it failed (failed)")


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
    formats: list[Format] = Field(description="what it downloads as")
    exports: dict[ExportFormat, ExportOut] = Field(
        default_factory=dict,
        description="the exports written (ready) or asked for and failed, by format",
    )


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
    """The descriptor of the format's root folder (step-N, step-N/hf or step-N/peft) and its
    entries; None when the checkpoint is gone or has no complete folder of that format."""
    try:
        step_fd = open_dir(f"step-{step}", ck_fd)
    except OSError:
        return None
    if fmt == "native":
        return step_fd, walk(step_fd, NOT_NATIVE)
    folder, _, marker = EXPORT_DIRS[fmt]
    try:
        fmt_fd = open_dir(folder, step_fd)
    except OSError:
        return None
    finally:
        os.close(step_fd)
    try:
        found = os.stat(marker, dir_fd=fmt_fd, follow_symlinks=False)
    except OSError:
        os.close(fmt_fd)
        return None
    if not stat.S_ISREG(found.st_mode):
        os.close(fmt_fd)
        return None
    return fmt_fd, walk(fmt_fd)


def _failure(step_fd: int, fmt: str) -> str | None:
    """The reason in step-N/FORMAT.failed.json (a plain file, no link followed), or None."""
    try:
        with _closing(open_file(failed_name(fmt), step_fd)) as fd:
            raw = os.read(fd, FAILED_MAX_BYTES)
    except OSError:
        return None
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    reason = body.get("reason") if isinstance(body, dict) else None
    if not isinstance(reason, str) or not reason.strip():
        reason = "the export failed (its record is unreadable)"
    return reason.strip()[:REASON_MAX_CHARS]


def export_failure(ck_fd: int, step: int, fmt: str) -> str | None:
    """Why step-N's export of ``fmt`` failed, when the trainer recorded that it did."""
    try:
        step_fd = open_dir(f"step-{step}", ck_fd)
    except OSError:
        return None
    with _closing(step_fd):
        return _failure(step_fd, fmt)


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
    exports: dict[ExportFormat, ExportOut]

    @property
    def hf_size(self) -> int | None:
        hf = self.exports.get("hf")
        return hf.size_bytes if hf is not None and hf.status == "ready" else None


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
            exports: dict[ExportFormat, ExportOut] = {}
            with _closing(native[0]) as step_fd:
                meta = _meta(step_fd)
                for fmt in EXPORT_FORMATS:
                    opened = open_format(ck_fd, step, fmt)
                    if opened is not None:
                        os.close(opened[0])
                        size = sum(e.size for e in opened[1])
                        exports[fmt] = ExportOut(status="ready", size_bytes=size)
                    elif (reason := _failure(step_fd, fmt)) is not None:
                        exports[fmt] = ExportOut(status="failed", reason=reason)
            found.append(Found(step, meta, sum(e.size for e in native[1]), exports))
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
                formats=["native", *(k for k, e in f.exports.items() if e.status == "ready")],
                exports=f.exports,
            )
        )
    return CheckpointList(job_id=job_id, items=items)
