"""The one rule for paths a tenant names (trainer.paths), on a real folder tree."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.paths import PathRefused, dataset_folder, owner_key, resolve_under


@pytest.fixture()
def root(tmp_path: Path) -> Path:
    root = tmp_path / "data"
    (root / "shared" / "corpus").mkdir(parents=True)
    (root / dataset_folder("alice", "corp")).mkdir(parents=True)
    (root / dataset_folder("bob", "mine")).mkdir(parents=True)
    (root / "to-alice").symlink_to(root / dataset_folder("alice", "corp"))
    (root / "shared" / "to-shared").symlink_to(root / "shared" / "corpus")
    (root / "shared" / "out").symlink_to(tmp_path)
    return root


def test_the_shared_area_resolves_and_need_not_exist_yet(root: Path) -> None:
    assert resolve_under(root, "shared/corpus", "f") == root.resolve() / "shared" / "corpus"
    assert resolve_under(root, "shared/later/x", "f") == root.resolve() / "shared/later/x"


@pytest.mark.parametrize(
    ("path", "said"),
    [
        ("/etc", "must be relative"),
        ("..", "plain relative path"),
        ("shared/../datasets", "plain relative path"),
        ("shared/./corpus", "plain relative path"),
        ("shared//corpus", "plain relative path"),
        ("shared/corpus/", "plain relative path"),
        ("", "plain relative path"),
        ("a\x00b", "NUL"),
        ("datasets", "not reachable by a path"),
        ("datasets/.tmp", "not reachable by a path"),
        (dataset_folder("alice", "corp"), "not reachable by a path"),
        (dataset_folder("bob", "mine"), "not reachable by a path"),
        ("to-alice", "to-alice is a symbolic link"),
        ("shared/to-shared", "shared/to-shared is a symbolic link"),
        ("shared/out/data/datasets", "shared/out is a symbolic link"),
    ],
)
def test_refused_with_the_field_and_never_the_root(root: Path, path: str, said: str) -> None:
    with pytest.raises(PathRefused, match=said) as info:
        resolve_under(root, path, "train.data.path")
    assert str(info.value).startswith("train.data.path")
    assert str(root) not in str(info.value)


def test_a_frozen_dataset_folder_is_its_owners_only(root: Path) -> None:
    mine = dataset_folder("alice", "corp")
    assert resolve_under(root, mine, "f", dataset="corp", owner="alice").name == "corp"
    assert resolve_under(root, mine, "f", dataset="corp").name == "corp"  # shape only
    for path, dataset, owner in [
        (mine, "corp", "bob"),  # the key is alice's
        (mine, "other", "alice"),  # not the dataset the spec names
        (f"{mine}/train_000.bin", "corp", "alice"),  # inside it
        (f"datasets/{owner_key('alice')}", "corp", "alice"),
        ("datasets/not-a-key/corp", "corp", None),
    ]:
        with pytest.raises(PathRefused, match="not reachable by a path"):
            resolve_under(root, path, "f", dataset=dataset, owner=owner)


def test_owner_keys_name_no_path_on_their_own() -> None:
    for owner in ("../x", "a/b", ".", "", "ü" * 80):
        key = owner_key(owner)
        assert "/" not in key and not key.startswith(".") and len(key) <= 45
    assert owner_key("alice") != owner_key("alice ")
