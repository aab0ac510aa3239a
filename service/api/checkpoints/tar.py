"""A checkpoint's files as one tar archive, made while it is sent: no copy, exact size, Range.

The archive is a fixed sequence of segments: each member's header (``TarInfo.tobuf``),
its bytes read from the file in chunks, the zero padding to 512 bytes; then the two zero
blocks and the padding to tar's 10240-byte record that ``tarfile`` writes. So its length is
known before the first byte (``Content-Length``), any byte range can be sent by skipping
to it (``Range``, for resumed downloads, with the ``ETag`` a client sends back in
``If-Range``), and two requests for an unchanged checkpoint get the same bytes: members in
sorted order, modes 0640/0750, owner 0 and no names, the files' own mtimes.

Member names are relative to the format's root (``meta.json``, ``dcp/.metadata`` for
native; ``config.json``, ``model.safetensors`` for hf), so ``tar -x -C DIR`` gives a folder
that ``trainer.export --checkpoint DIR`` or ``from_pretrained(DIR)`` reads as it is.

The files are opened when the request is answered (up to ``MAX_OPEN``; past that, as they
come): the trainer's retention deleting the checkpoint mid-download then changes nothing,
as an open file outlives its name. A file that shrank, or one past ``MAX_OPEN`` that is gone
by its turn, ends the stream early; the client sees fewer bytes than Content-Length said.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import tarfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from starlette.concurrency import run_in_threadpool

from service.api.checkpoints.files import Entry, open_dir, open_file

__all__ = ["Archive", "ArchiveChanged", "parse_range"]

log = logging.getLogger(__name__)

BLOCK = tarfile.BLOCKSIZE  # 512
RECORD = tarfile.RECORDSIZE  # 10240: what tarfile pads a closed archive to
CHUNK = 1 << 20  # bytes per read (one thread hop each)
MAX_OPEN = 256  # files held open from the start; a checkpoint has ~2 per rank
_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


class ArchiveChanged(Exception):
    """A file changed (or vanished) while the archive was being sent."""


def _header(entry: Entry) -> bytes:
    info = tarfile.TarInfo(entry.name + ("/" if entry.is_dir else ""))
    info.type = tarfile.DIRTYPE if entry.is_dir else tarfile.REGTYPE
    info.size = 0 if entry.is_dir else entry.size
    info.mode = 0o750 if entry.is_dir else 0o640
    info.mtime = entry.mtime_ns // 1_000_000_000
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    # PAX: plain ustar headers unless a name or a size (> 8 GiB) needs an extended one.
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


@dataclass
class _Segment:
    start: int
    length: int
    data: bytes | None  # header or padding; None: the bytes of entries[index]
    index: int = -1


@dataclass
class Archive:
    """The tar of ``entries`` under the folder ``root_fd`` (owned: `close` closes it)."""

    root_fd: int
    entries: list[Entry]
    segments: list[_Segment] = field(default_factory=list)
    size: int = 0
    _fds: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        pos = 0

        def add(length: int, data: bytes | None, index: int = -1) -> None:
            nonlocal pos
            if length:
                self.segments.append(_Segment(pos, length, data, index))
                pos += length

        for i, entry in enumerate(self.entries):
            head = _header(entry)
            add(len(head), head)
            if not entry.is_dir:
                add(entry.size, None, i)
                add(-entry.size % BLOCK, bytes(-entry.size % BLOCK))
        end = 2 * BLOCK
        end += -(pos + end) % RECORD
        add(end, bytes(end))
        self.size = pos

    @property
    def etag(self) -> str:
        """Strong: the same files (name, size, mtime, inode) give the same archive."""
        h = hashlib.sha256()
        for e in self.entries:
            h.update(f"{e.name}\0{e.is_dir}\0{e.size}\0{e.mtime_ns}\0{e.ino}\n".encode())
        return f'"{h.hexdigest()[:32]}"'

    def open_files(self) -> None:
        """Open the first MAX_OPEN files now (blocking); a vanished one is ArchiveChanged."""
        for i, entry in enumerate(self.entries):
            if len(self._fds) >= MAX_OPEN:
                break
            if not entry.is_dir:
                self._fds[i] = self._open(entry)

    def _open(self, entry: Entry) -> int:
        opened: list[int] = []
        try:
            parent = self.root_fd
            for part in entry.parts[:-1]:
                parent = open_dir(part, parent)
                opened.append(parent)
            fd = open_file(entry.parts[-1], parent)
        except OSError as exc:
            raise ArchiveChanged(f"{entry.name} is gone: {exc.strerror or exc}") from None
        finally:
            for d in opened:
                os.close(d)
        if os.fstat(fd).st_size < entry.size:
            os.close(fd)
            raise ArchiveChanged(f"{entry.name} shrank")
        return fd

    def _read(self, index: int, offset: int, n: int) -> bytes:
        fd = self._fds.get(index)
        if fd is None:
            fd = self._fds[index] = self._open(self.entries[index])
        data = os.pread(fd, n, offset)
        if len(data) != n:
            raise ArchiveChanged(f"{self.entries[index].name} shrank while being sent")
        return data

    async def body(self, start: int = 0, stop: int | None = None) -> AsyncIterator[bytes]:
        """The archive's bytes [start, stop), reading files on worker threads."""
        stop = self.size if stop is None else stop
        try:
            for seg in self.segments:
                seg_end = seg.start + seg.length
                if seg_end <= start:
                    continue
                if seg.start >= stop:
                    break
                a, b = max(start, seg.start) - seg.start, min(stop, seg_end) - seg.start
                if seg.data is not None:
                    yield seg.data[a:b]
                    continue
                while a < b:
                    n = min(CHUNK, b - a)
                    yield await run_in_threadpool(self._read, seg.index, a, n)
                    a += n
        except ArchiveChanged as exc:
            log.warning("checkpoint download cut short: %s", exc)
            raise

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if self.root_fd >= 0:
            os.close(self.root_fd)
            self.root_fd = -1


def parse_range(header: str | None, size: int) -> tuple[int, int] | bool | None:
    """``Range: bytes=a-b`` (one range) as [start, stop); None: send it all (no header, or
    one we do not serve, like several ranges); False: not satisfiable (416)."""
    if not header:
        return None
    m = _RANGE.fullmatch(header.strip())
    if m is None or (not m.group(1) and not m.group(2)):
        return None
    first, last = m.group(1), m.group(2)
    if not first:  # the last N bytes
        n = int(last)
        return (max(0, size - n), size) if n > 0 and size > 0 else False
    start = int(first)
    stop = min(size, int(last) + 1) if last else size
    if last and int(last) < start:
        return None  # malformed: ignored, as RFC 9110 says
    return (start, stop) if start < size else False
