"""trainer.data: shard format and validation, the windowed dataset, the deterministic sampler."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from trainer.data import (
    HEADER_INTS,
    MAGIC,
    VERSION,
    BatchSampler,
    DataError,
    TokenDataset,
    find_shards,
    open_shard,
    write_shard,
)

SEQ = 7  # windows of 8 tokens
WINDOW = SEQ + 1


def _header(path: Path) -> np.ndarray:
    return np.fromfile(path, dtype="<i4", count=HEADER_INTS)


def _write_raw(path: Path, header: list[int], tokens: np.ndarray, cut: int = 0) -> None:
    h = np.zeros(HEADER_INTS, dtype="<i4")
    h[: len(header)] = header
    data = h.tobytes() + tokens.astype("<u2").tobytes()
    path.write_bytes(data[: len(data) - cut] if cut else data)


def _split(folder: Path, lengths: list[int], split: str = "train") -> None:
    """Shards whose token k of shard s is s*10000 + k, so a window shows where it came from."""
    folder.mkdir(parents=True, exist_ok=True)
    for s, n in enumerate(lengths):
        write_shard(folder / f"{split}_{s:06d}.bin", s * 10000 + np.arange(n))


# --- shard format ---------------------------------------------------------------------------


def test_shard_header_round_trip(tmp_path: Path) -> None:
    tokens = np.random.default_rng(0).integers(0, 65536, size=1000).astype(np.uint16)
    path = tmp_path / "train_000000.bin"
    write_shard(path, tokens)

    header = _header(path)
    assert header[:3].tolist() == [MAGIC, VERSION, 1000]
    assert not header[3:].any()
    assert path.stat().st_size == HEADER_INTS * 4 + 1000 * 2
    mm = open_shard(path)
    assert mm.dtype == np.uint16
    np.testing.assert_array_equal(mm, tokens)
    # the atomic write leaves no temp file behind
    assert [p.name for p in tmp_path.iterdir()] == ["train_000000.bin"]


def test_write_shard_replaces_and_checks_tokens(tmp_path: Path) -> None:
    path = tmp_path / "train_000000.bin"
    write_shard(path, np.arange(10))
    write_shard(path, np.arange(20, 25))
    np.testing.assert_array_equal(open_shard(path), np.arange(20, 25))
    with pytest.raises(DataError, match="uint16"):
        write_shard(path, np.array([1, 70000]))
    with pytest.raises(DataError, match="no tokens"):
        write_shard(path, np.array([], dtype=np.uint16))
    with pytest.raises(DataError, match="integers"):
        write_shard(path, np.array([1.5]))
    # a refused write leaves the previous shard intact
    np.testing.assert_array_equal(open_shard(path), np.arange(20, 25))


@pytest.mark.parametrize(
    ("header", "n_tokens", "cut", "expected"),
    [
        ([1234, VERSION, 10], 10, 0, "not an llm.c token shard"),
        ([MAGIC, 7, 10], 10, 0, "header version other than 1"),
        ([MAGIC, VERSION, 10], 10, 6, "truncated"),
        ([MAGIC, VERSION, 100], 10, 0, "truncated"),
        ([MAGIC, VERSION, 0], 0, 0, "counts no tokens"),
        ([MAGIC, VERSION, 5], 10, 0, "trailing bytes"),
        ([MAGIC, VERSION, 10], 0, 1024 - 100, "shorter than its 1024-byte header"),
    ],
    ids=["magic", "version", "cut-tokens", "count-too-big", "count-zero", "too-long", "header"],
)
def test_bad_shard_is_a_clear_error(
    tmp_path: Path, header: list[int], n_tokens: int, cut: int, expected: str
) -> None:
    path = tmp_path / "train_000000.bin"
    _write_raw(path, header, np.arange(n_tokens), cut=cut)
    with pytest.raises(DataError, match=expected) as info:
        open_shard(path)
    assert str(path) in str(info.value)
    for value in header:  # what the file holds is never quoted back (issue 22)
        if value >= 100 and value not in (MAGIC, VERSION):  # the size may hold small digits
            assert str(value) not in str(info.value).replace(str(path), "")
    # the dataset reports the same error when it opens the folder
    with pytest.raises(DataError, match=expected):
        TokenDataset(tmp_path, "train", SEQ)


def test_missing_shard(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        open_shard(tmp_path / "nope.bin")


def test_find_shards(tmp_path: Path) -> None:
    _split(tmp_path, [20, 20, 20])
    _split(tmp_path, [20], split="val")
    (tmp_path / "train_notes.txt").write_text("not a shard")
    assert [p.name for p in find_shards(tmp_path, "train")] == [
        "train_000000.bin",
        "train_000001.bin",
        "train_000002.bin",
    ]
    assert [p.name for p in find_shards(tmp_path, "val")] == ["val_000000.bin"]
    with pytest.raises(DataError, match="unknown split"):
        find_shards(tmp_path, "test")


def test_missing_folder_and_empty_split(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=f"data folder {tmp_path / 'nope'} does not exist"):
        TokenDataset(tmp_path / "nope", "train", SEQ)
    (tmp_path / "file").write_text("x")
    with pytest.raises(DataError, match="is not a directory"):
        find_shards(tmp_path / "file", "train")
    _split(tmp_path / "d", [50])
    with pytest.raises(DataError, match=f"data folder {tmp_path / 'd'} has no val shards"):
        TokenDataset(tmp_path / "d", "val", SEQ)


def test_split_shorter_than_one_window(tmp_path: Path) -> None:
    _split(tmp_path, [WINDOW - 1, WINDOW - 1])  # 14 tokens in all, but no shard holds a window
    with pytest.raises(DataError, match="fewer than one window") as info:
        TokenDataset(tmp_path, "train", SEQ)
    assert str(tmp_path) in str(info.value)


# --- dataset ----------------------------------------------------------------------------------


def test_windows_never_cross_shards(tmp_path: Path) -> None:
    _split(tmp_path, [3 * WINDOW + 5, 2 * WINDOW, WINDOW - 1, WINDOW + 1])
    ds = TokenDataset(tmp_path, "train", SEQ)
    assert ds.num_samples == 3 + 2 + 0 + 1
    assert ds.num_tokens == 3 * WINDOW + 5 + 2 * WINDOW + WINDOW - 1 + WINDOW + 1
    expected = [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (3, 0)]  # (shard, window in shard)
    for i, (shard, w) in enumerate(expected):
        sample = ds.sample(i)
        assert sample.dtype == np.uint16 and sample.shape == (WINDOW,)
        np.testing.assert_array_equal(sample, shard * 10000 + w * WINDOW + np.arange(WINDOW))
    np.testing.assert_array_equal(
        ds.gather(np.array([5, 0, 3])), np.stack([ds.sample(5), ds.sample(0), ds.sample(3)])
    )
    with pytest.raises(IndexError):
        ds.sample(ds.num_samples)


# --- sampler ----------------------------------------------------------------------------------


@pytest.fixture()
def ds(tmp_path: Path) -> TokenDataset:
    # 48 + 48 + 24 = 120 windows over three shards
    _split(tmp_path, [48 * WINDOW + 3, 48 * WINDOW, 24 * WINDOW + 7])
    return TokenDataset(tmp_path, "train", SEQ)


def test_batch_shapes_and_shift(ds: TokenDataset) -> None:
    s = BatchSampler(ds, micro_batch_size=4, grad_accum_steps=2, rank=1, world=2, seed=3)
    x, y = s.batch(5, 1)
    assert x.shape == y.shape == (4, SEQ)
    assert x.dtype == y.dtype == torch.int64
    assert x.is_contiguous() and y.is_contiguous()
    windows = np.stack([ds.sample(int(i)) for i in s.indices(5, 1)]).astype(np.int64)
    np.testing.assert_array_equal(x.numpy(), windows[:, :-1])
    np.testing.assert_array_equal(y.numpy(), windows[:, 1:])


def test_batches_are_reproducible_across_objects(ds: TokenDataset) -> None:
    """A resumed run (a new sampler object) sees exactly the batches of an uninterrupted run."""
    straight = BatchSampler(ds, 4, 2, rank=1, world=2, seed=7)
    seen = {(st, m): straight.batch(st, m) for st in range(40) for m in range(2)}  # ~5 epochs
    resumed = BatchSampler(ds, 4, 2, rank=1, world=2, seed=7)
    for st in range(25, 40):
        for m in range(2):
            x, y = resumed.batch(st, m)
            assert torch.equal(x, seen[(st, m)][0]) and torch.equal(y, seen[(st, m)][1])
    # asking out of order (an eval, a resume further back) changes nothing either
    x, _ = resumed.batch(3, 0)
    assert torch.equal(x, seen[(3, 0)][0])
    other_seed = BatchSampler(ds, 4, 2, rank=1, world=2, seed=8)
    assert not torch.equal(other_seed.batch(0, 0)[0], seen[(0, 0)][0])


def test_one_process_sees_the_same_samples_as_two_ranks(ds: TokenDataset) -> None:
    one = BatchSampler(ds, 8, 2, rank=0, world=1, seed=1)
    ranks = [BatchSampler(ds, 4, 2, rank=r, world=2, seed=1) for r in range(2)]
    for step in range(20):  # crosses several epoch boundaries (120 samples, 16 a step)
        for micro in range(2):
            two = np.concatenate([r.indices(step, micro) for r in ranks])
            assert sorted(one.indices(step, micro)) == sorted(two)


@pytest.mark.parametrize(("batch", "world", "accum"), [(4, 2, 1), (3, 4, 2), (7, 3, 1)])
def test_every_sample_once_per_epoch_and_ranks_disjoint(
    ds: TokenDataset, batch: int, world: int, accum: int
) -> None:
    """Each epoch is a permutation of all samples dealt across ranks, even when a step spans two
    epochs (120 samples is not a multiple of 7 * 3)."""
    n = ds.num_samples
    samplers = [BatchSampler(ds, batch, accum, rank=r, world=world, seed=11) for r in range(world)]
    by_slot: dict[int, int] = {}
    rank_of: dict[int, int] = {}
    steps = 3 * n // (batch * world * accum) + 1
    for step in range(steps):
        for micro in range(accum):
            for r, s in enumerate(samplers):
                b = np.arange(batch)
                slots = ((step * accum + micro) * batch + b) * world + r
                for slot, idx in zip(slots.tolist(), s.indices(step, micro).tolist(), strict=True):
                    by_slot[slot] = idx
                    rank_of[slot] = r
    orders = []
    for epoch in range(3):
        order = [by_slot[s] for s in range(epoch * n, (epoch + 1) * n)]
        assert sorted(order) == list(range(n)), f"epoch {epoch} does not cover every sample once"
        per_rank = [
            {by_slot[s] for s in range(epoch * n, (epoch + 1) * n) if rank_of[s] == r}
            for r in range(world)
        ]
        for r in range(world):
            for q in range(r + 1, world):
                assert not per_rank[r] & per_rank[q], f"ranks {r} and {q} share samples"
        orders.append(order)
    # a fresh shuffle each pass
    assert orders[0] != orders[1] != orders[2]


def test_epoch_of_and_permutation_cache(ds: TokenDataset) -> None:
    s = BatchSampler(ds, 4, 1, rank=0, world=2, seed=0)  # 8 samples a step, 120 an epoch
    assert [s.epoch_of(st) for st in (0, 14, 15, 29, 30)] == [0, 0, 1, 1, 2]
    assert s.samples_per_step == 8
    perm0 = s.permutation(0).copy()
    for epoch in range(6):
        s.permutation(epoch)
    assert len(s._perms) <= 2  # memory stays bounded on long runs
    np.testing.assert_array_equal(s.permutation(0), perm0)  # recomputed identically


def test_sampler_rejects_bad_rank(ds: TokenDataset) -> None:
    with pytest.raises(ValueError, match="rank 2"):
        BatchSampler(ds, 4, 1, rank=2, world=2, seed=0)
    s = BatchSampler(ds, 4, 2, rank=0, world=1, seed=0)
    with pytest.raises(ValueError, match="micro"):
        s.batch(0, 2)


def test_shard_links_are_refused_never_followed(tmp_path: Path) -> None:
    """A ``train_*.bin`` that links to a file elsewhere (a shard, or a secret) is refused
    by name; the link's target is never opened, so none of its bytes reach the message."""
    outside = tmp_path / "outside"
    _split(outside, [50])
    secret = outside / "secret.txt"
    secret.write_bytes(b"ALICE-SECRET-KEY=hunter2" * 64)
    folder = tmp_path / "shared" / "corp"
    _split(folder, [50])
    for target in (outside / "train_000000.bin", secret):
        link = folder / "train_000001.bin"
        link.unlink(missing_ok=True)
        link.symlink_to(target)
        with pytest.raises(DataError, match=r"train_000001\.bin is a symbolic link") as info:
            TokenDataset(folder, "train", SEQ, label="corp")
        message = str(info.value)
        assert str(tmp_path) not in message and "ALICE" not in message
        assert message.startswith("data folder corp:")
        with pytest.raises(DataError, match="is a symbolic link"):
            open_shard(link)
    # the folder itself a link: refused too
    (tmp_path / "shared" / "alias").symlink_to(folder, target_is_directory=True)
    with pytest.raises(DataError, match="alias is a symbolic link"):
        TokenDataset(tmp_path / "shared" / "alias", "train", SEQ, label="alias")


def test_messages_name_the_label_not_the_server_path(tmp_path: Path) -> None:
    path = tmp_path / "d" / "train_000000.bin"
    path.parent.mkdir()
    _write_raw(path, [4242, VERSION, 10], np.arange(10))
    with pytest.raises(DataError) as info:
        TokenDataset(tmp_path / "d", "train", SEQ, label="shared/d")
    assert "shard shared/d/train_000000.bin is not an llm.c token shard" in str(info.value)
    assert str(tmp_path) not in str(info.value) and "4242" not in str(info.value)
