"""Token data: llm.c-format uint16 shards, memory-mapped, and the deterministic batch sampler.

A shard is a 256-int32 header (magic 20240520, version 1, token count) followed by the tokens
as little-endian uint16, the layout of llm.c's ``dev/data`` scripts, so shards made by either
tool work in both.

A split ("train" or "val") is every ``{split}*.bin`` shard in a folder, cut into
non-overlapping windows of ``seq_len + 1`` tokens that never cross a shard boundary.
``trainer.prepare`` also writes ``meta.json`` beside the shards (tokenizer, vocab size, token
counts); shards made elsewhere (llm.c) come without it. `check_vocab` makes sure the model's
embedding covers every token id before a run starts.

The sampler makes every batch a pure function of ``(seed, step, micro, rank, world)``, so a
resumed run sees exactly the batches it would have seen, with no sampler state to save. Sample
slots are numbered globally and dealt to ranks round-robin (rank-strided, like
``DistributedSampler``); each pass over the data (epoch) uses its own permutation, seeded by
``(seed, epoch)``, which is what ``DistributedSampler.set_epoch`` gives.

**Loss masks** (chat and instruction data, ``trainer.sft``): beside a token shard
``train_000000.bin`` a dataset may hold ``train_000000.mask``, the same 256-int32 header
with magic ``MASK_MAGIC`` (20241224), version 1 and the same token count, then one uint8 per
token: 1 if the token is a target (carries loss), 0 if not. Either every shard of a split
has its mask or none has (DataError otherwise); masks are opened as the shards are, never
through a link, and must count exactly their shard's tokens. With masks, the batch's
targets ``y`` are ``IGNORE_INDEX`` (-100, ``cross_entropy``'s default) where the mask is 0.

**Example boundaries and packing** (``TokenDataset(..., packing=True)``, the spec's
``train.data.packing``): beside a shard a chat/completion dataset also holds
``train_000000.docs``, the 256-int32 header with magic ``DOCS_MAGIC`` (20241225), version 1
and the count of examples that start in the shard, then their start offsets as int32,
strictly increasing, inside the shard. A shard's tokens before its first start are the tail
of an example cut by the shard (or split) boundary: packed as an example of its own. Packed,
a sample is a row of ``seq_len`` predictions made of whole examples (an example of ``L``
tokens makes ``L - 1``), placed best-fit in order (each example into the fullest row it
fits, else a new row), the rest of a row padding (targets ``IGNORE_INDEX``). An example of
more than ``seq_len + 1`` tokens is cut to its first ``seq_len + 1`` or dropped, as the
dataset's ``overlong`` option (meta.json's ``sft.overlong``) says. With each row come its
document ids (``[B, seq_len]``, one id per example, the padding one more): the models restart
positions at each example and mask attention to within it (block-diagonal causal).
``efficiency`` is the share of a packed split's row slots that are examples' tokens.

Only :meth:`BatchSampler.batch` needs torch, and imports it itself, so the shard tools
(``trainer.prepare``, the service's ``trainq data prepare``) run without loading torch.
"""

from __future__ import annotations

import bisect
import fnmatch
import json
import os
import tempfile
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from trainer.files import NotPlainFile, make_dirs, open_dir, open_plain, read_plain, set_mode

if TYPE_CHECKING:
    import torch

__all__ = [
    "DOCS_MAGIC",
    "HEADER_INTS",
    "IGNORE_INDEX",
    "MAGIC",
    "MASK_MAGIC",
    "VERSION",
    "BatchSampler",
    "DataError",
    "TokenDataset",
    "check_vocab",
    "find_shards",
    "open_docs",
    "open_mask",
    "open_shard",
    "write_docs",
    "write_mask",
    "write_shard",
]

MAGIC = 20240520
MASK_MAGIC = 20241224
MASK_SUFFIX = ".mask"
DOCS_MAGIC = 20241225
DOCS_SUFFIX = ".docs"
OVERLONG = ("drop", "truncate")
IGNORE_INDEX = -100
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
SPLITS = ("train", "val")
META_FILE = "meta.json"  # written by trainer.prepare next to its shards
_TOKEN_DTYPE = np.dtype("<u2")
_MASK_DTYPE = np.dtype("u1")
_HEADER_DTYPE = np.dtype("<i4")
_DOCS_DTYPE = np.dtype("<i4")


class DataError(Exception):
    """Token data that cannot be used; the message names the file or folder and what is wrong."""


def write_shard(path: str | os.PathLike[str], tokens: np.ndarray) -> None:
    """Write ``tokens`` as one llm.c-format shard, atomically (temp file, fsync, rename)."""
    path = Path(path)
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise DataError(f"{path}: tokens must be a 1-D array, got shape {arr.shape}")
    if arr.size == 0:
        raise DataError(f"{path}: refusing to write a shard with no tokens")
    if arr.dtype != _TOKEN_DTYPE:
        if not np.issubdtype(arr.dtype, np.integer):
            raise DataError(f"{path}: tokens must be integers, got dtype {arr.dtype}")
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi > 0xFFFF:
            raise DataError(f"{path}: token ids must fit uint16 (0..65535), got {lo}..{hi}")
        arr = arr.astype(_TOKEN_DTYPE)
    if arr.size > np.iinfo(np.int32).max:
        raise DataError(f"{path}: {arr.size} tokens do not fit one shard's int32 count")
    _write_atomic(path, MAGIC, arr)


def write_mask(path: str | os.PathLike[str], mask: np.ndarray) -> None:
    """Write a loss mask (1 = a target) for the shard of the same stem, atomically."""
    path = Path(path)
    arr = np.asarray(mask)
    if arr.ndim != 1 or arr.size == 0:
        raise DataError(f"{path}: a mask is a non-empty 1-D array, got shape {arr.shape}")
    _write_atomic(path, MASK_MAGIC, (arr != 0).astype(_MASK_DTYPE))


def write_docs(path: str | os.PathLike[str], starts: np.ndarray) -> None:
    """Write the start offsets of the examples that begin in the shard of the same stem."""
    path = Path(path)
    arr = np.asarray(starts, dtype=np.int64)
    if arr.ndim != 1 or (arr.size and (arr[0] < 0 or np.any(np.diff(arr) <= 0))):
        raise DataError(f"{path}: example starts are a 1-D strictly increasing array")
    _write_atomic(path, DOCS_MAGIC, arr.astype(_DOCS_DTYPE))


def _write_atomic(path: Path, magic: int, arr: np.ndarray) -> None:
    header = np.zeros(HEADER_INTS, dtype=_HEADER_DTYPE)
    header[0], header[1], header[2] = magic, VERSION, arr.size
    make_dirs(path.parent)
    # The temp file lives next to the target so the rename stays on one filesystem (atomic).
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        set_mode(fd)  # mkstemp's 0600 would keep the dataset from its readers (trainer.files)
        with os.fdopen(fd, "wb") as f:
            f.write(header.tobytes())
            f.write(np.ascontiguousarray(arr).tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _shard_file(path: Path, dir_fd: int | None, name: str) -> int:
    """A descriptor of the shard, opened without following a link (trainer.files)."""
    try:
        return open_plain(path.name if dir_fd is not None else path, dir_fd=dir_fd)
    except FileNotFoundError:
        raise DataError(f"shard {name} does not exist") from None
    except NotPlainFile as exc:
        raise DataError(
            f"shard {name} {exc.strerror}: shards are read as regular files, never through a link"
        ) from None
    except OSError as exc:
        raise DataError(f"shard {name}: cannot open: {exc.strerror}") from None


def open_shard(
    path: str | os.PathLike[str], *, dir_fd: int | None = None, label: str | None = None
) -> np.memmap:
    """Validate a shard's header and size, and memory-map its tokens (read-only uint16).

    The file is opened without following a link (relative to ``dir_fd``, its folder, when
    given). Messages name it as ``label`` (default: ``path``) and never quote its bytes: a
    wrong header is said to be wrong, not what it holds."""
    path = Path(path)
    name = label or str(path)
    fd = _shard_file(path, dir_fd, name)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(fd).st_size
        if size < HEADER_BYTES:
            raise DataError(
                f"shard {name} is {size} bytes, shorter than its {HEADER_BYTES}-byte header"
            )
        header = np.frombuffer(os.pread(fd, HEADER_BYTES, 0), dtype=_HEADER_DTYPE)
        magic, version, count = (int(v) for v in header[:3])
        if magic != MAGIC:
            raise DataError(
                f"shard {name} is not an llm.c token shard (its header lacks the magic number"
                f" {MAGIC})"
            )
        if version != VERSION:
            raise DataError(f"shard {name} has a header version other than {VERSION} (uint16)")
        if count <= 0:
            raise DataError(f"shard {name}: its header counts no tokens; a shard needs one")
        expected = HEADER_BYTES + count * _TOKEN_DTYPE.itemsize
        if size < expected:
            raise DataError(
                f"shard {name} is truncated: its {size} bytes are fewer than its header's"
                " token count needs"
            )
        if size > expected:
            raise DataError(
                f"shard {name} has trailing bytes after the tokens its header counts"
                " (header and size disagree)"
            )
        # The map keeps its own reference to the file: closing ``f`` leaves it valid.
        return np.memmap(f, dtype=_TOKEN_DTYPE, mode="r", offset=HEADER_BYTES, shape=(count,))


def mask_name(shard: str) -> str:
    """The mask file of token shard ``shard`` (``train_000000.bin`` -> ``train_000000.mask``)."""
    return shard[: -len(".bin")] + MASK_SUFFIX if shard.endswith(".bin") else shard + MASK_SUFFIX


def open_mask(
    shard: str | os.PathLike[str], count: int, *, dir_fd: int | None = None, label: str = ""
) -> np.memmap | None:
    """The loss mask beside ``shard`` (None when it has none), memory-mapped read-only;
    DataError unless its header is a mask's for exactly ``count`` tokens. Opened as the
    shards are: without following a link, relative to ``dir_fd`` when given."""
    shard = Path(shard)
    path = shard.with_name(mask_name(shard.name))
    name = label or str(path)
    try:
        fd = open_plain(path.name if dir_fd is not None else path, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except NotPlainFile as exc:
        raise DataError(
            f"mask {name} {exc.strerror}: masks are read as regular files, never through a link"
        ) from None
    except OSError as exc:
        raise DataError(f"mask {name}: cannot open: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(fd).st_size
        header = np.frombuffer(os.pread(fd, HEADER_BYTES, 0), dtype=_HEADER_DTYPE)
        ok = header.size == HEADER_INTS and (int(header[0]), int(header[1])) == (
            MASK_MAGIC, VERSION,
        )  # fmt: skip
        if not ok or int(header[2]) != count or size != HEADER_BYTES + count:
            raise DataError(
                f"mask {name} is not a loss mask of its shard's {count} tokens (header or"
                " size disagree)"
            )
        return np.memmap(f, dtype=_MASK_DTYPE, mode="r", offset=HEADER_BYTES, shape=(count,))


def docs_name(shard: str) -> str:
    """The example-starts file of token shard ``shard`` (``train_000000.docs``)."""
    return shard[: -len(".bin")] + DOCS_SUFFIX if shard.endswith(".bin") else shard + DOCS_SUFFIX


def open_docs(
    shard: str | os.PathLike[str], count: int, *, dir_fd: int | None = None, label: str = ""
) -> np.ndarray | None:
    """The example starts beside ``shard`` (None when it has none), as int64; DataError
    unless the header is a docs file's and the starts increase strictly inside ``count``
    tokens. Opened as the shards are: without following a link."""
    shard = Path(shard)
    path = shard.with_name(docs_name(shard.name))
    name = label or str(path)
    try:
        fd = open_plain(path.name if dir_fd is not None else path, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except NotPlainFile as exc:
        raise DataError(
            f"example starts {name} {exc.strerror}: they are read as regular files, never"
            " through a link"
        ) from None
    except OSError as exc:
        raise DataError(f"example starts {name}: cannot open: {exc.strerror}") from None
    try:
        size = os.fstat(fd).st_size
        header = np.frombuffer(os.pread(fd, HEADER_BYTES, 0), dtype=_HEADER_DTYPE)
        ok = header.size == HEADER_INTS and (int(header[0]), int(header[1])) == (
            DOCS_MAGIC, VERSION,
        )  # fmt: skip
        n = int(header[2]) if ok else -1
        if not ok or n < 0 or size != HEADER_BYTES + n * _DOCS_DTYPE.itemsize:
            raise DataError(f"example starts {name}: header and size disagree")
        starts = np.frombuffer(os.pread(fd, n * 4, HEADER_BYTES), dtype=_DOCS_DTYPE)
    finally:
        os.close(fd)
    starts = starts.astype(np.int64)
    if starts.size and (starts[0] < 0 or starts[-1] >= count or np.any(np.diff(starts) <= 0)):
        raise DataError(
            f"example starts {name} are not increasing offsets inside the shard's {count} tokens"
        )
    return starts


def _meta_overlong(folder: Path) -> str:
    """The dataset's ``overlong`` option (meta.json's ``sft`` report); ``drop`` without one."""
    try:
        meta = json.loads(read_plain(folder / META_FILE, limit=1 << 20))
        value = meta["sft"]["overlong"]
    except (OSError, ValueError, TypeError, KeyError):
        return "drop"
    return value if value in OVERLONG else "drop"


def pack_rows(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Best-fit in order: each item of ``lengths`` (each <= ``capacity``) into the open row
    with the least room that still fits it, else a new row. Returns each item's row and its
    offset in the row, and the number of rows."""
    rows = np.empty(lengths.size, dtype=np.int64)
    offsets = np.empty(lengths.size, dtype=np.int64)
    room: list[tuple[int, int]] = []  # (room left, row), sorted
    used: list[int] = []
    for i, n in enumerate(lengths.tolist()):
        j = bisect.bisect_left(room, (n, -1))
        if j < len(room):
            left, row = room.pop(j)
        else:
            left, row = capacity, len(used)
            used.append(0)
        rows[i], offsets[i] = row, used[row]
        used[row] += n
        if left - n > 0:
            bisect.insort(room, (left - n, row))
    return rows, offsets, len(used)


def find_shards(
    folder: str | os.PathLike[str],
    split: str,
    *,
    dir_fd: int | None = None,
    label: str | None = None,
) -> list[Path]:
    """The sorted ``{split}*.bin`` shards in ``folder`` (listed through ``dir_fd`` when
    given); DataError when there are none, or when one is a symbolic link (never followed)."""
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    folder = Path(folder)
    name = label or str(folder)
    if dir_fd is None:
        if not folder.exists():
            raise DataError(f"data folder {name} does not exist")
        if not folder.is_dir():
            raise DataError(f"data folder {name} is not a directory")
    shards = []
    with os.scandir(dir_fd if dir_fd is not None else folder) as entries:
        for entry in entries:
            if not fnmatch.fnmatchcase(entry.name, f"{split}*.bin"):
                continue
            if entry.is_symlink():
                raise DataError(
                    f"data folder {name}: {entry.name} is a symbolic link; links in data"
                    " folders are not followed"
                )
            if entry.is_file(follow_symlinks=False):
                shards.append(folder / entry.name)
    if not shards:
        raise DataError(f"data folder {name} has no {split} shards ({split}*.bin)")
    return sorted(shards)


def _open_folder(folder: Path, name: str) -> int:
    try:
        return open_dir(folder)
    except FileNotFoundError:
        raise DataError(f"data folder {name} does not exist") from None
    except NotPlainFile:
        raise DataError(f"data folder {name} is a symbolic link; links are not followed") from None
    except NotADirectoryError:
        raise DataError(f"data folder {name} is not a directory") from None
    except OSError as exc:
        raise DataError(f"data folder {name}: cannot open: {exc.strerror}") from None


class TokenDataset:
    """Every shard of one split, memory-mapped, as ``num_samples`` windows of seq_len+1 tokens.

    Window ``i`` is ``x = w[:-1]``, ``y = w[1:]``. Windows do not overlap and never cross a
    shard boundary; a shard's tail shorter than a window is not used. The folder and its
    shards are opened without following links; messages name them by ``label`` (the spec's
    ``data.path``; default: the folder as given), never by the server's absolute path.
    """

    def __init__(
        self,
        folder: str | os.PathLike[str],
        split: str,
        seq_len: int,
        label: str | None = None,
        *,
        packing: bool = False,
    ) -> None:
        if seq_len < 1:
            raise DataError(f"seq_len must be >= 1, got {seq_len}")
        self.folder = Path(folder)
        self.label = label or str(self.folder)
        self.split = split
        self.seq_len = seq_len
        self.window = seq_len + 1
        dir_fd = _open_folder(self.folder, self.label)
        try:
            self.paths = find_shards(self.folder, split, dir_fd=dir_fd, label=self.label)
            self.shards: list[np.memmap] = [
                open_shard(p, dir_fd=dir_fd, label=f"{self.label}/{p.name}") for p in self.paths
            ]
            masks = [
                open_mask(
                    p, int(s.shape[0]), dir_fd=dir_fd, label=f"{self.label}/{mask_name(p.name)}"
                )
                for p, s in zip(self.paths, self.shards, strict=True)
            ]
            docs = [
                open_docs(
                    p, int(s.shape[0]), dir_fd=dir_fd, label=f"{self.label}/{docs_name(p.name)}"
                )
                for p, s in zip(self.paths, self.shards, strict=True)
            ] if packing else []  # fmt: skip
        finally:
            os.close(dir_fd)
        if any(m is None for m in masks) and any(m is not None for m in masks):
            raise DataError(
                f"data folder {self.label}: some {split} shards have a loss mask (.mask) and"
                " some not; a split has one for every shard or none"
            )
        # Loss masks, one per shard (chat and instruction data), or None: every token a target.
        self.masks: list[np.memmap] | None = masks if masks and masks[0] is not None else None  # type: ignore[assignment]
        self.num_tokens = sum(int(s.shape[0]) for s in self.shards)
        self.packed = packing
        if packing:
            if any(d is None for d in docs):
                raise DataError(
                    f"data folder {self.label}: data.packing needs the examples' boundaries"
                    f" (.docs beside each {split} shard), which chat and completion datasets"
                    " have; this one has none"
                )
            self._pack(docs)  # type: ignore[arg-type]
            return
        counts = np.array([s.shape[0] // self.window for s in self.shards], dtype=np.int64)
        # _starts[k] is the global index of shard k's first window; _starts[-1] == num_samples.
        self._starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.num_samples = int(self._starts[-1])
        if self.num_samples == 0:
            raise DataError(
                f"data folder {self.label}: the {split} split has {self.num_tokens} tokens, "
                f"fewer than one window of seq_len+1 = {self.window}"
            )
        self._offsets = np.arange(self.window, dtype=np.int64)

    def _pack(self, docs: list[np.ndarray]) -> None:
        """Cut the shards into examples at their starts and pack them (module docstring)."""
        overlong = _meta_overlong(self.folder)
        shard, start, size = [], [], []
        for k, (tokens, starts) in enumerate(zip(self.shards, docs, strict=True)):
            edges = np.unique(np.concatenate([[0], starts, [tokens.shape[0]]]))
            shard.append(np.full(edges.size - 1, k, dtype=np.int64))
            start.append(edges[:-1])
            size.append(np.diff(edges))
        seg_shard, seg_start, seg_size = (np.concatenate(a) for a in (shard, start, size))
        too_long = seg_size > self.window
        self.pack_truncated = self.pack_dropped = 0
        if overlong == "truncate":
            self.pack_truncated = int(too_long.sum())
            seg_size = np.minimum(seg_size, self.window)
        else:
            self.pack_dropped = int(too_long.sum())
        keep = (seg_size >= 2) & (~too_long | (overlong == "truncate"))
        seg_shard, seg_start, seg_size = seg_shard[keep], seg_start[keep], seg_size[keep]
        rows, offsets, n_rows = pack_rows(seg_size - 1, self.seq_len)
        order = np.lexsort((offsets, rows))  # by row, then place in the row
        self._seg = np.stack([seg_shard, seg_start, seg_size, offsets])[:, order]
        self._row_first = np.searchsorted(rows[order], np.arange(n_rows + 1)).astype(np.int64)
        self.examples = int(seg_size.size)
        self.num_samples = n_rows
        self.efficiency = float((seg_size - 1).sum()) / max(1, n_rows * self.seq_len)
        if self.num_samples == 0:
            raise DataError(
                f"data folder {self.label}: the {self.split} split has no example of"
                f" 2 tokens or more within seq_len+1 = {self.window}"
            )

    def gather_packed(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Packed rows ``indices``: inputs, targets (``IGNORE_INDEX`` where no target, as
        the masks and the padding say) and document ids, each ``[len(indices), seq_len]``
        int64; an example's inputs are its tokens but the last, its targets all but the
        first."""
        idx = np.asarray(indices, dtype=np.int64)
        T = self.seq_len
        x = np.zeros((idx.size, T), dtype=np.int64)
        y = np.full((idx.size, T), IGNORE_INDEX, dtype=np.int64)
        doc = np.empty((idx.size, T), dtype=np.int64)
        for r, i in enumerate(idx.tolist()):
            first, last = int(self._row_first[i]), int(self._row_first[i + 1])
            doc[r] = last - first  # the padding: a document of its own
            for d, (k, a, n, o) in enumerate(self._seg[:, first:last].T.tolist()):
                tokens = self.shards[k][a : a + n].astype(np.int64)
                x[r, o : o + n - 1] = tokens[:-1]
                target = tokens[1:]
                if self.masks is not None:
                    target = np.where(self.masks[k][a + 1 : a + n] != 0, target, IGNORE_INDEX)
                y[r, o : o + n - 1] = target
                doc[r, o : o + n - 1] = d
        return x, y, doc

    def __len__(self) -> int:
        return self.num_samples

    def max_token(self) -> int:
        """The largest token id in the split's shards (used windows or not): one pass over
        the memory-mapped shards, no copy of them."""
        return max(int(shard.max()) for shard in self.shards)

    def sample(self, i: int) -> np.ndarray:
        """Window ``i`` as a uint16 array of length seq_len+1."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range 0..{self.num_samples - 1}")
        return self.gather(np.array([i], dtype=np.int64))[0]

    def gather(self, indices: np.ndarray) -> np.ndarray:
        """Windows ``indices`` as a ``[len(indices), seq_len+1]`` uint16 array (one copy)."""
        return self._gather(self.shards, indices, _TOKEN_DTYPE)

    def gather_mask(self, indices: np.ndarray) -> np.ndarray | None:
        """The loss masks of windows ``indices`` (uint8, like ``gather``), or None: no masks."""
        return None if self.masks is None else self._gather(self.masks, indices, _MASK_DTYPE)

    def _gather(self, arrays: list[np.memmap], indices: np.ndarray, dtype: np.dtype) -> np.ndarray:
        idx = np.asarray(indices, dtype=np.int64)
        out = np.empty((idx.size, self.window), dtype=dtype)
        shard_of = np.searchsorted(self._starts, idx, side="right") - 1
        # Usually every sample of a batch is in one or two shards: one fancy-index read each.
        for k in np.unique(shard_of):
            rows = np.flatnonzero(shard_of == k)
            starts = (idx[rows] - self._starts[k]) * self.window
            out[rows] = arrays[k][starts[:, None] + self._offsets]
        return out


def _meta_vocab(folder: Path, splits: Iterable[TokenDataset]) -> int | None:
    """The vocab size in the folder's meta.json, if it describes these very shards: its
    token count for each split must be the shards' (a meta.json left beside shards made
    later, by another tool or another prepare, says nothing about them)."""
    try:
        meta = json.loads(read_plain(folder / META_FILE, limit=1 << 20))
        vocab = meta["vocab_size"]
        counts = {split: meta[f"{split}_tokens"] for split in SPLITS}
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        return None
    if any(counts[ds.split] != ds.num_tokens for ds in splits):
        return None
    return vocab


def check_vocab(name: str, vocab_size: int, splits: Iterable[TokenDataset]) -> None:
    """DataError unless the model's ``vocab_size`` covers every token id of ``splits``.

    A token id at or past the vocab size indexes past the embedding: the run would fail
    only at its first forward pass, as an IndexError deep in torch (or a device-side assert
    on a GPU), after the process group and the model were built. ``name`` is the dataset as
    the spec names it (``data.path``).

    The vocab comes from the folder's meta.json when it describes these shards: O(1),
    whatever the size of the data, and the bound that matters (a tokenizer of 50257 ids
    needs a model of 50257, whatever ids one sample happens to use). Without one (shards of
    llm.c or any other tool) the shards themselves are read for their largest id: one
    sequential pass over the memory-mapped files, which only such data pays for.
    """
    splits = list(splits)
    if not splits:
        return
    vocab = _meta_vocab(splits[0].folder, splits)
    if vocab is not None:
        if vocab > vocab_size:
            raise DataError(
                f"dataset {name!r} has vocab {vocab} (max token id {vocab - 1}) but "
                f"model.vocab_size is {vocab_size}; set model.vocab_size to at least {vocab}"
            )
        return
    top = max(ds.max_token() for ds in splits)
    if top >= vocab_size:
        raise DataError(
            f"dataset {name!r} has max token id {top} but model.vocab_size is {vocab_size}; "
            f"set model.vocab_size to at least {top + 1}"
        )


class BatchSampler:
    """Deterministic rank-strided batches: a pure function of (seed, step, micro, rank, world).

    Slot ``s = ((step * grad_accum + micro) * B + b) * world + rank`` for ``b`` in ``range(B)``.
    Slot ``s`` is in epoch ``s // num_samples`` at position ``s % num_samples``, and its sample
    is ``perm(epoch)[position]`` where ``perm(epoch)`` is a permutation of the samples from
    ``numpy.random.Generator(PCG64((seed, epoch)))``. So each epoch shows every sample exactly
    once, ranks never share a sample within an epoch, and one process with micro batch
    ``world * B`` sees the same set of samples per step as ``world`` ranks with ``B``.
    """

    _CACHED_EPOCHS = 2  # a batch spans at most two epochs; older permutations are dropped

    def __init__(
        self,
        dataset: TokenDataset,
        micro_batch_size: int,
        grad_accum_steps: int,
        rank: int,
        world: int,
        seed: int,
        *,
        pin_memory: bool = False,
    ) -> None:
        if micro_batch_size < 1 or grad_accum_steps < 1:
            raise ValueError("micro_batch_size and grad_accum_steps must be >= 1")
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in a world of size {world}")
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.grad_accum_steps = grad_accum_steps
        self.rank = rank
        self.world = world
        self.seed = seed
        self.pin_memory = pin_memory
        self._perms: OrderedDict[int, np.ndarray] = OrderedDict()
        self._b = np.arange(micro_batch_size, dtype=np.int64)

    @property
    def samples_per_step(self) -> int:
        """Samples one optimizer step consumes across all ranks."""
        return self.micro_batch_size * self.grad_accum_steps * self.world

    def permutation(self, epoch: int) -> np.ndarray:
        """The sample order of ``epoch`` (cached for the last two epochs asked for)."""
        perm = self._perms.get(epoch)
        if perm is None:
            rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
            perm = rng.permutation(self.dataset.num_samples)
            self._perms[epoch] = perm
            while len(self._perms) > self._CACHED_EPOCHS:
                self._perms.popitem(last=False)
        else:
            self._perms.move_to_end(epoch)
        return perm

    def indices(self, step: int, micro: int) -> np.ndarray:
        """Dataset sample indices of this rank's micro batch ``micro`` at ``step``."""
        if step < 0 or not 0 <= micro < self.grad_accum_steps:
            raise ValueError(f"bad (step, micro) = ({step}, {micro})")
        n = self.dataset.num_samples
        slots = (step * self.grad_accum_steps + micro) * self.micro_batch_size + self._b
        slots = slots * self.world + self.rank
        epochs, positions = np.divmod(slots, n)
        out = np.empty_like(slots)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            out[mask] = self.permutation(int(epoch))[positions[mask]]
        return out

    def batch(self, step: int, micro: int) -> tuple[torch.Tensor, ...]:
        """``(x, y)``: int64 ``[B, seq_len]`` CPU tensors (pinned when ``pin_memory``); with
        loss masks, ``y`` is ``IGNORE_INDEX`` where a token is no target. A packed dataset
        adds a third, the document ids (``TokenDataset.gather_packed``)."""
        import torch  # here, so that shard tools (trainer.prepare, the service) never load torch

        indices = self.indices(step, micro)
        if self.dataset.packed:
            out = tuple(torch.from_numpy(a) for a in self.dataset.gather_packed(indices))
            return tuple(t.pin_memory() for t in out) if self.pin_memory else out
        windows = torch.from_numpy(self.dataset.gather(indices).astype(np.int64))
        x = windows[:, :-1]
        y = windows[:, 1:]
        mask = self.dataset.gather_mask(indices)
        if mask is not None:
            y = y.masked_fill(torch.from_numpy(mask[:, 1:] == 0), IGNORE_INDEX)
        if self.pin_memory:
            return x.contiguous().pin_memory(), y.contiguous().pin_memory()
        return x.contiguous(), y.contiguous()

    def epoch_of(self, step: int) -> int:
        """The epoch that the first sample slot of ``step`` (any rank) falls in."""
        return (step * self.samples_per_step) // self.dataset.num_samples
