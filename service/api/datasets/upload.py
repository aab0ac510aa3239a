"""An upload's bytes, checked as they stream in and written to the dataset's work file.

Each format has a check that sees every chunk in order, keeps a bounded state, and raises
:class:`Refused` (a 422 naming ``body``) at the first bad byte, so a bad upload is refused
while it streams and nothing of it stays on disk:

- ``text``: UTF-8 (an incremental decoder; the error names the byte offset and the byte).
- ``jsonl``: one JSON object per line with a string ``text`` (blank lines skipped; the
  error names the line); the texts, each ending with a newline, are what is written and
  prepared. A line is at most ``MAX_LINE_BYTES``.
- ``chat`` / ``completion``: JSON Lines of conversations or prompt/completion pairs, each
  line checked by ``trainer.sft_lines.check_line`` (unknown role, no assistant turn, empty
  content, bad weight, malformed JSON, non-UTF-8). Bad lines are gathered, not refused one
  by one: the upload is refused (422) once ``MAX_PROBLEMS`` are found, or at its end, with
  each listed by line number. The lines are written as they came (blank ones too), so the
  preparation's line numbers are the upload's.
- ``bin``: one or more llm.c shards back to back (``cat train_*.bin val_*.bin``), each
  checked for its magic (20240520), version (1), a token count that the bytes that follow
  hold exactly, and every token id below the stated vocab size.

An empty corpus (no bytes, no jsonl text, no shard) is refused by ``finish``.
"""

from __future__ import annotations

import codecs
import json
import os
import struct
from pathlib import Path
from typing import Any, Protocol

from trainer.files import make_dirs, set_mode
from trainer.sft_lines import SFT_FORMATS, LineError, Problems, check_line

__all__ = ["MAX_LINE_BYTES", "Refused", "SftCheck", "UploadSink", "make_check"]

MAX_LINE_BYTES = 16 * 1024 * 1024
# trainer.data's shard layout, named here so the API imports numpy only for a bin upload.
MAGIC, VERSION, HEADER_BYTES = 20240520, 1, 256 * 4


class Refused(ValueError):
    """The upload's content is not what its format says; one line."""


class Check(Protocol):
    def feed(self, chunk: bytes) -> bytes: ...  # what to write of it

    def finish(self) -> int: ...  # the document count


class TextCheck:
    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self._seen = 0

    def _decode(self, chunk: bytes, final: bool) -> None:
        pending = self._decoder.getstate()[0]
        try:
            self._decoder.decode(chunk, final)
        except UnicodeDecodeError as exc:
            where = self._seen - len(pending) + exc.start
            bad = (pending + chunk)[exc.start]
            raise Refused(
                f"the text is not UTF-8: byte 0x{bad:02x} at byte offset {where} starts no"
                " valid character"
            ) from None

    def feed(self, chunk: bytes) -> bytes:
        # ASCII is UTF-8: checked at memory speed, without decoding (mid-character: decode)
        if not (chunk.isascii() and not self._decoder.getstate()[0]):
            self._decode(chunk, False)
        self._seen += len(chunk)
        return chunk

    def finish(self) -> int:
        self._decode(b"", True)
        if self._seen == 0:
            raise Refused("the upload is empty; a dataset needs some text")
        return 1


class JsonlCheck:
    def __init__(self) -> None:
        self._carry = b""
        self._line = 0
        self.documents = 0

    def _record(self, raw: bytes) -> bytes:
        self._line += 1
        if not raw.strip():
            return b""
        where = f"line {self._line}"
        try:
            record = json.loads(raw)
        except UnicodeDecodeError:
            raise Refused(f"{where} is not UTF-8") from None
        except ValueError as exc:
            raise Refused(f"{where} is not JSON: {exc}") from None
        text = record.get("text") if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise Refused(f'{where} has no "text" string (each line is {{"text": "..."}})')
        if not text:
            return b""
        try:
            out = text.encode("utf-8")
        except UnicodeEncodeError:
            raise Refused(f"{where}'s text holds a lone surrogate (not valid Unicode)") from None
        self.documents += 1
        return out if out.endswith(b"\n") else out + b"\n"

    def feed(self, chunk: bytes) -> bytes:
        data = self._carry + chunk
        lines = data.split(b"\n")
        self._carry = lines.pop()
        if len(self._carry) > MAX_LINE_BYTES:
            raise Refused(f"line {self._line + 1} is longer than {MAX_LINE_BYTES} bytes")
        return b"".join([self._record(line) for line in lines])

    def last(self) -> bytes:
        tail, self._carry = self._carry, b""
        return self._record(tail) if tail else b""

    def finish(self) -> int:
        if self.documents == 0:
            raise Refused('the upload holds no text: no line has a non-empty "text"')
        return self.documents


class SftCheck:
    """Chat or completion JSON Lines; ``finish`` returns the example count."""

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt
        self._carry = b""
        self._line = 0
        self.examples = 0
        self.problems = Problems()

    def _record(self, raw: bytes) -> None:
        self._line += 1
        try:
            example = check_line(self.fmt, raw)
        except LineError as exc:
            self.problems.add(self._line, exc)
            if self.problems.full():
                raise Refused(self.problems.summary()) from None
            return
        if example is not None:
            self.examples += 1

    def feed(self, chunk: bytes) -> bytes:
        data = self._carry + chunk
        lines = data.split(b"\n")
        self._carry = lines.pop()
        if len(self._carry) > MAX_LINE_BYTES:
            raise Refused(
                f"line {self._line + len(lines) + 1} is longer than {MAX_LINE_BYTES} bytes"
            )
        for line in lines:
            self._record(line)
        return chunk

    def last(self) -> bytes:
        tail, self._carry = self._carry, b""
        if tail:
            self._record(tail)
        return b""

    def finish(self) -> int:
        self.last()
        if self.problems:
            raise Refused(self.problems.summary())
        if self.examples == 0:
            raise Refused(f"the upload holds no {self.fmt} example: every line is blank")
        return self.examples


class BinCheck:
    """llm.c shards back to back; ``finish`` returns the shard count."""

    def __init__(self, vocab_size: int) -> None:
        import numpy

        self._np: Any = numpy
        self.vocab = vocab_size
        self.shards = 0
        self._offset = 0  # bytes of the upload seen
        self._header = b""  # a header being read
        self._left = 0  # token bytes left in the current shard
        self._odd = b""  # a token split across chunks
        self._count = 0

    def feed(self, chunk: bytes) -> bytes:
        view = memoryview(chunk)
        while len(view):
            if self._left == 0:
                need = HEADER_BYTES - len(self._header)
                self._header += bytes(view[:need])
                taken = min(need, len(view))
                view = view[taken:]
                self._offset += taken
                if len(self._header) == HEADER_BYTES:
                    self._start_shard()
                continue
            take = min(self._left, len(view))
            self._tokens(view[:take])
            view = view[take:]
            self._left -= take
            self._offset += take
        return chunk

    def _start_shard(self) -> None:
        magic, version, count = struct.unpack("<3i", self._header[:12])
        where = f"shard {self.shards + 1} (at byte offset {self._offset - HEADER_BYTES})"
        if magic != MAGIC:
            raise Refused(f"{where} has magic {magic}, expected {MAGIC}: not an llm.c shard")
        if version != VERSION:
            raise Refused(f"{where} has version {version}, expected {VERSION} (uint16 tokens)")
        if count <= 0:
            raise Refused(f"{where} says it holds {count} tokens; a shard holds at least one")
        self.shards += 1
        self._header = b""
        self._count = count
        self._left = 2 * count

    def _tokens(self, data: memoryview) -> None:
        raw = self._odd + bytes(data) if self._odd else data
        even = len(raw) - len(raw) % 2
        self._odd = bytes(raw[even:])
        if even:
            top = int(self._np.frombuffer(raw[:even], "<u2").max())
            if top >= self.vocab:
                raise Refused(
                    f"shard {self.shards} holds token id {top}, not below the vocab size"
                    f" {self.vocab} (query vocab_size)"
                )

    def finish(self) -> int:
        if self._header or self._left:
            have = len(self._header) if self._header else 2 * self._count - self._left
            what = "header" if self._header else f"{self._count} tokens"
            raise Refused(
                f"the upload ends inside shard {self.shards + (1 if self._header else 0)}:"
                f" its {what} need more bytes than the {have} that came (truncated, or the"
                " header's token count and the size disagree)"
            )
        if self.shards == 0:
            raise Refused("the upload is empty; send one or more llm.c shards")
        return self.shards


def make_check(fmt: str, vocab_size: int) -> Check:
    if fmt == "text":
        return TextCheck()
    if fmt == "jsonl":
        return JsonlCheck()
    if fmt in SFT_FORMATS:
        return SftCheck(fmt)
    return BinCheck(vocab_size)


class UploadSink:
    """The work file an upload streams into (0640), through its format's check. Not thread
    safe; one writer at a time (the route calls it from a worker thread per buffer)."""

    def __init__(self, path: Path, check: Check) -> None:
        make_dirs(path.parent)
        self.path = path
        self.check = check
        self.received = 0
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
        set_mode(fd)
        self._file = os.fdopen(fd, "wb")

    def write(self, data: bytes) -> None:
        self.received += len(data)
        out = self.check.feed(data)
        if out:
            self._file.write(out)

    def finish(self) -> int:
        """The document count; Refused if the corpus is bad or empty."""
        if isinstance(self.check, JsonlCheck):
            tail = self.check.last()
            if tail:
                self._file.write(tail)
        documents = self.check.finish()
        self._file.close()
        return documents

    def abort(self) -> None:
        self._file.close()
        self.path.unlink(missing_ok=True)
