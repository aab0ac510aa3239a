"""llm.c shards written as their tokens stream in, with bounded memory.

:class:`ShardStream` appends tokens (byte-level: each byte a token, or ready uint16 tokens)
to ``{split}_000000.bin``, ``{split}_000001.bin``, ... of ``shard_tokens`` tokens each. A
shard is a hidden part file (``.{name}.part``, 0640) holding a placeholder header until
:meth:`~ShardStream.close`, which writes its header, fsyncs it and renames it into place:
the result is byte for byte what :func:`trainer.data.write_shard` writes for the same
tokens cut at the same places (``trainer.prepare`` and the API's dataset preparation both
write through here).

:meth:`~ShardStream.move_tail` serves a stream whose length is known only at its end (an
upload prepared while it arrives): the last tokens, the val split, move to another stream
and the part files are cut back, so the train shards never need to be rewritten whole.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from trainer.data import HEADER_BYTES, HEADER_INTS, MAGIC, VERSION
from trainer.files import make_dirs, set_mode

__all__ = ["ShardStream", "val_tokens"]

_PLACEHOLDER = bytes(HEADER_BYTES)
_COPY_TOKENS = 1 << 22  # the tail moves in pieces of 8 MiB


def val_tokens(total: int, val_fraction: float) -> int:
    """How many of ``total`` tokens are the val split (its last ones); ValueError if the
    split leaves no train token. trainer.prepare's rule: rounded, at least one if any."""
    n_val = round(total * val_fraction)
    if val_fraction > 0 and n_val == 0:
        n_val = 1
    if n_val >= total:
        raise ValueError(
            f"{total} tokens are too few to split off a val fraction of {val_fraction}"
        )
    return int(n_val)


def _header(count: int) -> bytes:
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = MAGIC, VERSION, count
    return header.tobytes()


class ShardStream:
    def __init__(self, out: Path, split: str, shard_tokens: int) -> None:
        if not 1 <= shard_tokens <= np.iinfo(np.int32).max:
            raise ValueError(f"shard tokens must be in 1..{np.iinfo(np.int32).max}")
        self.out = make_dirs(Path(out))
        self.split = split
        self.shard_tokens = shard_tokens
        self.tokens = 0  # appended so far, all shards
        self._parts: list[Path] = []  # one per shard, in order
        self._fd: int | None = None  # the last part, while it has room
        self._room = 0  # tokens the last part still takes
        self._unsynced = 0  # bytes written since the last fsync

    def _name(self, n: int) -> str:
        return f"{self.split}_{n:06d}.bin"

    def _open_part(self) -> int:
        part = self.out / f".{self._name(len(self._parts))}.part"
        fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o640)
        set_mode(fd)
        self._parts.append(part)
        os.write(fd, _PLACEHOLDER)
        self._room = self.shard_tokens
        return fd

    def _end_part(self) -> None:
        if self._fd is not None:
            os.fsync(self._fd)  # now, while more tokens may still be on their way
            os.close(self._fd)
            self._fd, self._unsynced = None, 0

    def _write(self, raw: memoryview) -> None:
        """Little-endian uint16 tokens as bytes, cut at shard boundaries."""
        while len(raw):
            if self._fd is None or self._room == 0:
                self._end_part()
                self._fd = self._open_part()
            take = min(self._room, len(raw) // 2)
            piece = raw[: 2 * take]
            while len(piece):  # os.write may write less than asked
                piece = piece[os.write(self._fd, piece) :]
            raw = raw[2 * take :]
            self._room -= take
            self.tokens += take
            self._unsynced += 2 * take

    def append_bytes(self, data: bytes | bytearray | memoryview) -> None:
        """Byte-level tokens: each byte of ``data`` is one token."""
        if len(data):
            tokens = np.frombuffer(data, dtype=np.uint8).astype("<u2")
            self._write(tokens.data.cast("B"))

    def append_tokens(self, tokens: np.ndarray) -> None:
        """uint16 tokens (any integer array whose values fit)."""
        arr = np.ascontiguousarray(tokens, dtype="<u2")
        self._write(arr.data.cast("B"))

    def sync(self, at_least: int = 0) -> None:
        """fsync what was written to the open part, if more than ``at_least`` bytes (an
        idle moment's work, so that ``close`` has little left to flush)."""
        if self._fd is not None and self._unsynced > at_least:
            os.fdatasync(self._fd)
            self._unsynced = 0

    def move_tail(self, keep: int, into: ShardStream) -> None:
        """Tokens from ``keep`` on move, in order, to ``into``; this stream keeps ``keep``."""
        if not 0 <= keep <= self.tokens:
            raise ValueError(f"cannot keep {keep} of {self.tokens} tokens")
        self._end_part()
        first = keep // self.shard_tokens
        for n in range(first, len(self._parts)):
            part = self._parts[n]
            cut = max(0, keep - n * self.shard_tokens)  # the tokens this part keeps
            with part.open("rb") as f:
                f.seek(HEADER_BYTES + 2 * cut)
                while chunk := f.read(2 * _COPY_TOKENS):
                    into._write(memoryview(chunk))
            if cut:
                os.truncate(part, HEADER_BYTES + 2 * cut)
            else:
                part.unlink()
        self._parts = self._parts[: first + (1 if keep % self.shard_tokens else 0)]
        self.tokens = keep
        self._room = 0  # appending after a cut starts a new shard: not a use we have

    def close(self) -> int:
        """Headers in, fsynced, renamed into place; the number of shards."""
        self._end_part()
        left = self.tokens
        for n, part in enumerate(self._parts):
            count = min(left, self.shard_tokens)
            left -= count
            fd = os.open(part, os.O_WRONLY)
            try:
                os.pwrite(fd, _header(count), 0)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(part, self.out / self._name(n))
        shards, self._parts = len(self._parts), []
        return shards

    def discard(self) -> None:
        """Remove the part files (a preparation that failed or was called off)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        for part in self._parts:
            part.unlink(missing_ok=True)
        self._parts = []
