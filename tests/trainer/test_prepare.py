"""trainer.prepare: text to shards (byte-level and a local HF tokenizer), the CLI, the demo."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from trainer.assets import make_corpus
from trainer.data import DataError, TokenDataset, find_shards, open_shard, write_shard
from trainer.prepare import prepare, prepare_demo
from trainer.shard_stream import ShardStream
from trainer.tokenizer import TokenizerError, dataset_tokenizer

TEXT = "Grüße aus Köln! 日本語も少し。\nThe quick brown fox jumps over the lazy dog.\n" * 40


def _run(
    args: list[str], env: dict[str, str], cwd: Path, timeout: float = 60, umask: int = -1
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainer.prepare", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        umask=umask,
    )


def _tokens(folder: Path, split: str) -> np.ndarray:
    return np.concatenate([np.asarray(open_shard(p)) for p in find_shards(folder, split)])


def test_cli_byte_level_round_trip(
    tmp_path: Path, subprocess_env: dict[str, str], repo_root: Path
) -> None:
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(TEXT, encoding="utf-8")
    b.write_text("Second file.\n", encoding="utf-8")
    out = tmp_path / "data"
    n = len((TEXT + "Second file.\n").encode("utf-8"))

    res = _run(
        ["--out", str(out), "--val-fraction", "0.25", "--shard-tokens", "1000", str(a), str(b)],
        subprocess_env,
        repo_root,
    )
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""
    n_val = round(n * 0.25)
    train_shards = -(-(n - n_val) // 1000)
    val_shards = -(-n_val // 1000)
    assert res.stdout.strip() == (
        f"prepared {out}: {n - n_val} train tokens in {train_shards} shard(s), {n_val} val "
        f"tokens in {val_shards} shard(s), vocab size 256 (byte)"
    )
    assert len(find_shards(out, "train")) == train_shards > 1
    # the tokens are the UTF-8 bytes, files in order, val the last quarter
    tokens = np.concatenate([_tokens(out, "train"), _tokens(out, "val")])
    assert bytes(tokens.astype(np.uint8)).decode("utf-8") == TEXT + "Second file.\n"
    meta = json.loads((out / "meta.json").read_text())
    assert meta["vocab_size"] == 256 and meta["val_tokens"] == n_val
    # and the dataset reads what prepare wrote
    assert TokenDataset(out, "val", 31).num_samples > 0


def _bad_utf8(tmp_path: Path) -> list[str]:
    p = tmp_path / "latin1.txt"
    p.write_bytes("café".encode("latin-1"))
    return [str(p)]


def _empty(tmp_path: Path) -> list[str]:
    p = tmp_path / "empty.txt"
    p.write_bytes(b"")
    return [str(p)]


def _missing(tmp_path: Path) -> list[str]:
    return [str(tmp_path / "missing.txt")]


def _directory(tmp_path: Path) -> list[str]:
    (tmp_path / "adir").mkdir()
    return [str(tmp_path / "adir")]


def _bad_fraction(tmp_path: Path) -> list[str]:
    p = tmp_path / "ok.txt"
    p.write_text("hello world\n")
    return ["--val-fraction", "1.5", str(p)]


def _bad_tokenizer(tmp_path: Path) -> list[str]:
    p, t = tmp_path / "ok.txt", tmp_path / "tokenizer.json"
    p.write_text("hello world\n")
    t.write_text("{not json")
    return ["--tokenizer", str(t), str(p)]


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (_bad_utf8, "latin1.txt is not UTF-8 text (byte 0xe9 at offset 3)"),
        (_empty, "empty.txt is empty"),
        (_missing, "missing.txt does not exist"),
        (_directory, "adir is a directory"),
        (_bad_fraction, "val fraction must be in [0, 1), got 1.5"),
        (_bad_tokenizer, "tokenizer.json cannot be loaded"),
    ],
    ids=["not-utf8", "empty", "missing", "directory", "val-fraction", "bad-tokenizer"],
)
def test_cli_bad_input_is_one_line(
    tmp_path: Path,
    subprocess_env: dict[str, str],
    repo_root: Path,
    make: Callable[[Path], list[str]],
    expected: str,
) -> None:
    args = make(tmp_path)
    out = tmp_path / "out"
    res = _run(["--out", str(out), *args], subprocess_env, repo_root)
    assert res.returncode == 1
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("prepare: error: ") and expected in lines[0]
    assert not out.exists() or not any(out.iterdir()), "a failed prepare wrote shards"


@pytest.mark.parametrize("umask", [0o000, 0o077])
def test_prepared_dataset_is_group_readable_at_most(
    umask: int, tmp_path: Path, subprocess_env: dict[str, str], repo_root: Path
) -> None:
    """Folders 0750 and files 0640 whatever the umask: not 0600 (mkstemp's), which kept the
    dataset from the group's jobs, nor world-readable."""
    src = tmp_path / "a.txt"
    src.write_text(TEXT, encoding="utf-8")
    out = tmp_path / "datasets" / "mine"
    args = ["--out", str(out), "--shard-tokens", "1000", str(src)]
    res = _run(args, subprocess_env, repo_root, umask=umask)
    assert res.returncode == 0, res.stderr
    made = [out.parent, *sorted(out.parent.rglob("*"))]
    assert len(made) > 5 and out / "meta.json" in made
    wrong = {
        str(p): oct(p.stat().st_mode & 0o777)
        for p in made
        if p.stat().st_mode & 0o777 != (0o750 if p.is_dir() else 0o640)
    }
    assert wrong == {}


def test_existing_shards_need_overwrite(tmp_path: Path) -> None:
    src = tmp_path / "a.txt"
    src.write_text("a" * 5000)
    out = tmp_path / "out"
    prepare([src], out, shard_tokens=1000)
    assert len(find_shards(out, "train")) == 5
    src.write_text("b" * 1500)
    with pytest.raises(DataError, match="already holds shards"):
        prepare([src], out)
    summary = prepare([src], out, shard_tokens=1000, overwrite=True)
    # the stale train_000002..4 from the larger run are gone
    assert [p.name for p in find_shards(out, "train")] == ["train_000000.bin", "train_000001.bin"]
    assert summary.train_tokens + summary.val_tokens == 1500
    assert set(_tokens(out, "train").tolist()) == {ord("b")}


def _train_bpe(path: Path, text: str, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    tok.save(str(path))


def test_hf_tokenizer_round_trip(
    tmp_path: Path, subprocess_env: dict[str, str], repo_root: Path
) -> None:
    from tokenizers import Tokenizer

    text = make_corpus.generate(target_bytes=20_000)
    src, tj = tmp_path / "corpus.txt", tmp_path / "tokenizer.json"
    src.write_text(text, encoding="utf-8")
    _train_bpe(tj, text, vocab_size=400)
    tok = Tokenizer.from_file(str(tj))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    assert vocab > 256

    out = tmp_path / "data"
    res = _run(["--out", str(out), "--tokenizer", str(tj), str(src)], subprocess_env, repo_root)
    assert res.returncode == 0, res.stderr
    assert f"vocab size {vocab} (tokenizer.json)" in res.stdout
    ids = np.concatenate([_tokens(out, "train"), _tokens(out, "val")])
    assert ids.max() >= 256  # merges were used, so this is not byte-level in disguise
    assert ids.size < len(text.encode("utf-8")) // 2
    # The dataset carries its tokenizer: a copy (0640), named relatively in meta.json.
    copy = out / "tokenizer.json"
    assert copy.read_bytes() == tj.read_bytes() and oct(copy.stat().st_mode & 0o777) == "0o640"
    assert json.loads((out / "meta.json").read_text())["tokenizer"] == "tokenizer.json"
    assert dataset_tokenizer(out) == copy
    assert Tokenizer.from_file(str(dataset_tokenizer(out))).decode(ids.tolist()) == text

    # Prepared again byte-level: the copy goes, or it would claim these shards.
    res = _run(["--out", str(out), "--overwrite", str(src)], subprocess_env, repo_root)
    assert res.returncode == 0, res.stderr
    assert not copy.exists() and dataset_tokenizer(out) == "byte"


def test_dataset_tokenizer_reads_old_meta_files(tmp_path: Path) -> None:
    """Datasets prepared before the copy name the absolute path of the file used."""
    old, used = tmp_path / "old", tmp_path / "elsewhere" / "tokenizer.json"
    src = tmp_path / "a.txt"
    src.write_text(TEXT)
    prepare([src], old)
    assert dataset_tokenizer(old) == "byte"
    assert dataset_tokenizer(tmp_path / "hand-written") == "byte"  # shards, no meta.json
    meta = json.loads((old / "meta.json").read_text())
    (old / "meta.json").write_text(json.dumps({**meta, "tokenizer": str(used)}))
    with pytest.raises(TokenizerError, match="prepare it again"):
        dataset_tokenizer(old)  # the file it names is gone
    used.parent.mkdir()
    used.write_text("{}")
    assert dataset_tokenizer(old) == used
    (old / "tokenizer.json").symlink_to(used)  # a copy is the dataset's own, never a link out
    with pytest.raises(TokenizerError, match=r"tokenizer\.json is a symbolic link"):
        dataset_tokenizer(old)


def test_hf_vocab_must_fit_uint16(
    tmp_path: Path, subprocess_env: dict[str, str], repo_root: Path
) -> None:
    from tokenizers import Tokenizer, models

    tj = tmp_path / "big.json"
    vocab = {f"w{i}": i for i in range(70_000)}
    Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0")).save(str(tj))
    src = tmp_path / "a.txt"
    src.write_text("w1 w2 w3\n")
    res = _run(
        ["--out", str(tmp_path / "o"), "--tokenizer", str(tj), str(src)], subprocess_env, repo_root
    )
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert "vocab size 70000" in res.stderr and "uint16" in res.stderr


def test_demo_corpus_is_generated_and_shards(tmp_path: Path) -> None:
    text = make_corpus.DEMO_PATH.read_text(encoding="utf-8")
    assert text == make_corpus.generate(), (
        "demo.txt is stale: run python -m trainer.assets.make_corpus"
    )
    assert 100_000 < len(text.encode("utf-8")) < 400_000

    out = prepare_demo(tmp_path / "demo")
    train = TokenDataset(out, "train", 64)
    val = TokenDataset(out, "val", 64)
    assert len(train.paths) > 1 and train.num_samples > val.num_samples > 0
    tokens = np.concatenate([_tokens(out, "train"), _tokens(out, "val")])
    assert bytes(tokens.astype(np.uint8)).decode("utf-8") == text
    prepare_demo(out)  # idempotent: a second `trainq up --demo` simply rewrites it
    assert TokenDataset(out, "train", 64).num_samples == train.num_samples


def _written(tokens: np.ndarray, folder: Path, split: str, shard_tokens: int) -> dict[str, bytes]:
    """What write_shard writes for ``tokens`` cut every ``shard_tokens``: the oracle."""
    files = {}
    for n, start in enumerate(range(0, tokens.size, shard_tokens)):
        path = folder / f"{split}_{n:06d}.bin"
        write_shard(path, tokens[start : start + shard_tokens])
        files[path.name] = path.read_bytes()
    return files


def _bins(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.suffix == ".bin"}


@pytest.mark.parametrize(
    ("sizes", "val_fraction", "shard_tokens"),
    [((1000,), 0.1, 100), ((997, 3), 0.1, 1000), ((640,), 0.0, 64), ((333, 333), 0.5, 7)],
    ids=["exact-shards", "one-shard", "no-val", "many-small"],
)
def test_byte_level_shards_are_what_write_shard_writes_for_the_bytes(
    tmp_path: Path, sizes: tuple[int, ...], val_fraction: float, shard_tokens: int
) -> None:
    """The byte path streams pieces of the files into shards (no str of the text); the
    shards are byte for byte write_shard's of the files' bytes, split and cut as before."""
    rng = np.random.default_rng(len(sizes))
    chars = np.array(list("aé\nñ日z"))
    files, raw = [], b""
    for i, n in enumerate(sizes):
        text = "".join(rng.choice(chars, size=n)).encode()
        (tmp_path / f"{i}.txt").write_bytes(text)
        files.append(tmp_path / f"{i}.txt")
        raw += text
    summary = prepare(files, tmp_path / "out", val_fraction=val_fraction, shard_tokens=shard_tokens)
    tokens = np.frombuffer(raw, dtype=np.uint8).astype(np.uint16)
    n_val = max(round(tokens.size * val_fraction), 1 if val_fraction else 0)
    want = tmp_path / "want"
    expected = _written(tokens[: tokens.size - n_val], want, "train", shard_tokens)
    expected |= _written(tokens[tokens.size - n_val :], want, "val", shard_tokens)
    assert _bins(tmp_path / "out") == expected
    assert (summary.train_tokens, summary.val_tokens) == (tokens.size - n_val, n_val)
    assert summary.train_shards == sum(k.startswith("train") for k in expected)
    assert summary.val_shards == sum(k.startswith("val") for k in expected)
    assert [p.name for p in (tmp_path / "out").iterdir() if p.name.startswith(".")] == []


def test_a_bad_byte_past_the_first_piece_is_named_at_its_offset(tmp_path: Path) -> None:
    """The byte path checks UTF-8 a piece (4 MiB) at a time; the offset stays the file's."""
    src = tmp_path / "big.txt"
    src.write_bytes(b"a" * ((1 << 22) - 1) + "ñ".encode() + b"ok\xffrest")
    with pytest.raises(DataError, match=rf"byte 0xff at offset {(1 << 22) + 3}\)"):
        prepare([src], tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("total", "keep", "shard_tokens"), [(50, 45, 10), (50, 40, 10), (7, 1, 3)])
def test_a_stream_moves_its_tail_to_another(
    tmp_path: Path, total: int, keep: int, shard_tokens: int
) -> None:
    """What an upload prepared as it arrives relies on: all the tokens into train, then the
    last ones moved to val; the same shards as the two splits written directly."""
    tokens = np.arange(total, dtype=np.uint16) * 300
    train = ShardStream(tmp_path / "out", "train", shard_tokens)
    for piece in np.array_split(tokens, 4):
        train.append_tokens(piece)
    val = ShardStream(tmp_path / "out", "val", shard_tokens)
    train.move_tail(keep, val)
    assert (train.close(), val.close()) == (
        -(-keep // shard_tokens),
        -(-(total - keep) // shard_tokens),
    )
    expected = _written(tokens[:keep], tmp_path / "want", "train", shard_tokens)
    expected |= _written(tokens[keep:], tmp_path / "want", "val", shard_tokens)
    assert _bins(tmp_path / "out") == expected
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(expected)
