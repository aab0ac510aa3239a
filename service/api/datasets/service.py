"""Datasets as API objects: names, folders, the store, and what a job spec's dataset means.

A dataset is an owner's corpus, uploaded with ``POST /v1/datasets`` (service.api.datasets.router
.datasets), checked as it streams in (service.api.datasets.upload), then prepared into llm.c
token shards by a child process (service.api.datasets.prepare, run by ``DatasetWork``).

- **Names** are ``[A-Za-z0-9][A-Za-z0-9._-]{0,63}`` without ``..``, unique per owner.
- **Folders**: a ready dataset is ``DATA_ROOT/datasets/<owner key>/<name>/`` (shards,
  ``meta.json``, and ``tokenizer.json`` when a Hugging Face tokenizer made them). The owner
  key is made from the owner (a token's name, which may hold any character): its safe
  characters, then 12 hex digits of its sha256, so no owner string ever names a path on its
  own and two owners never share a folder. Work in progress lives in
  ``DATA_ROOT/datasets/.tmp/<id>.*`` (the same file system, so publishing is a rename).
- **Status**: ``uploading -> preparing -> ready | failed``. While a process uploads or
  prepares a dataset it keeps ``updated_at`` fresh (every ``dataset_heartbeat_s``); the
  reconciler fails one whose heartbeat is older than ``dataset_stale_s`` (its process died)
  and removes its work files (``reap_stale``).
- **Jobs**: ``train.data.dataset: NAME`` is resolved at submit for the submitting owner
  (``resolve_dataset``): unknown, not ready, or a vocab larger than the model's is a 422
  naming ``train.data.dataset``. With ``train.data.packing``, a dataset that is not chat or
  completion is a 422 naming ``train.data.packing``, and an example past ``seq_len + 1``
  tokens that packing would drop (``overlong=drop``) one naming ``train.model.seq_len``.
  Else the frozen spec keeps the name and its ``data.path`` is the dataset's folder.
  ``datasets/`` is never nameable by a path (``trainer.paths``): the worker and the trainer
  accept that folder only as the frozen folder of ``data.dataset`` (the worker checks it is
  the job owner's), and a dataset's in-use check compares the owner's jobs'
  ``data.dataset``, never a path's spelling.
"""

from __future__ import annotations

import json
import re
import shutil
import stat
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field
from sqlalchemy import Connection, delete, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from service.api.core.auth import Principal
from service.api.core.errors import Conflict, InvalidInput
from service.api.core.models import DATASETS, JOBS, new_job_id, utcnow
from service.api.core.schemas import UTCDatetime
from service.api.datasets import quota
from service.api.jobs.schemas import JobSpec
from trainer.config import ConfigError, HFModelConfig, resolve_data_path
from trainer.files import read_plain
from trainer.paths import DATASETS_AREA, dataset_folder, owner_key

__all__ = [
    "ACTIVE",
    "FORMATS",
    "DatasetList",
    "DatasetOut",
    "begin_upload",
    "check_name",
    "dataset_out",
    "folder_of",
    "jobs_using",
    "owner_key",
    "reap_stale",
    "remove_work",
    "resolve_dataset",
    "resolve_tokenizer",
    "work_paths",
]

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
FORMATS = ("text", "jsonl", "bin", "chat", "completion")
Format = Literal["text", "jsonl", "bin", "chat", "completion"]
Overlong = Literal["drop", "truncate"]
Status = Literal["uploading", "preparing", "ready", "failed"]
BYTE = "byte"
ROOT_DIR = DATASETS_AREA
WORK_DIR = ".tmp"
ACTIVE = ("uploading", "preparing")
ACTIVE_JOBS = ("queued", "running", "cancelling")


class DatasetOut(BaseModel):
    id: str
    name: str
    owner: str
    status: Status
    reason: str | None = Field(None, description="why it failed")
    format: Format
    tokenizer: str = Field(description='"byte", or the tokenizer.json under the data root')
    path: str = Field(description="its folder, relative to the data root (a job's data.path)")
    bytes: int = Field(description="bytes uploaded (so far, while uploading)")
    disk_bytes: int = Field(
        0,
        description="what it counts against your TRAINQ_DATASET_MAX_OWNER_BYTES: reserved"
        " while it uploads and prepares, its folder's size once ready, 0 once failed",
    )
    documents: int | None = Field(
        None,
        description="text: 1; jsonl: records with text; bin: shards; chat, completion:"
        " examples uploaded",
    )
    report: dict[str, Any] | None = Field(
        None,
        description="chat and completion, once ready: examples kept, tokens, target_tokens"
        " and loss_share (the share of tokens that carry loss), dropped (reason -> examples),"
        " truncated, and the options (max_len, overlong, train_on_inputs, chat_template)",
    )
    train_tokens: int | None = None
    val_tokens: int | None = None
    vocab_size: int | None = None
    created_at: UTCDatetime
    updated_at: UTCDatetime
    ready_at: UTCDatetime | None = None


class DatasetList(BaseModel):
    items: list[DatasetOut]


def dataset_out(row: Any) -> DatasetOut:
    return DatasetOut.model_validate(dict(row))


def check_name(name: str, loc: list[str | int]) -> str:
    if not NAME_RE.fullmatch(name) or ".." in name:
        raise InvalidInput.at(
            loc,
            "a dataset name is 1 to 64 of A-Z a-z 0-9 . _ -, starting with a letter or digit,"
            " without '..'",
        )
    return name


def folder_of(owner: str, name: str) -> str:
    """The dataset's folder relative to the data root (what a job's data.path becomes)."""
    return dataset_folder(owner, name)


def work_paths(data_root: Path, dataset_id: str) -> tuple[Path, Path]:
    """(the upload's file, the preparation's output folder) of a dataset in progress."""
    work = Path(data_root) / ROOT_DIR / WORK_DIR
    return work / f"{dataset_id}.upload", work / f"{dataset_id}.out"


def remove_work(data_root: Path, dataset_id: str) -> None:
    upload, out = work_paths(data_root, dataset_id)
    upload.unlink(missing_ok=True)
    shutil.rmtree(out, ignore_errors=True)


def resolve_tokenizer(data_root: Path, value: str) -> tuple[str, Path | None]:
    """``byte``, or a Hugging Face tokenizer in the shared area of the data root (the rule of
    ``trainer.paths``: never an uploaded dataset's, not even the caller's own): a
    ``tokenizer.json`` or a folder holding one; (what is stored, the file). InvalidInput
    names ``query.tokenizer`` and never says more of a file than that it is not one."""
    if value == BYTE:
        return BYTE, None
    loc: list[str | int] = ["query", "tokenizer"]
    try:
        found = resolve_data_path(value, data_root, field="tokenizer")
    except ConfigError as exc:
        raise InvalidInput.at(loc, str(exc)) from exc
    try:
        if stat.S_ISDIR(found.lstat().st_mode):
            found = found / "tokenizer.json"
        plain = stat.S_ISREG(found.lstat().st_mode)  # a link is not followed
    except OSError:
        plain = False
    if not plain or found.suffix != ".json":
        raise InvalidInput.at(
            loc,
            f"tokenizer {value!r} is neither 'byte' nor a tokenizer.json (or a folder holding"
            " one, not a link) in the shared area of the data root",
        )
    return value, found


# -- the store ------------------------------------------------------------------------------


def get_row(conn: Connection | Session, owner: str, name: str) -> Any:
    return (
        conn.execute(select(DATASETS).where(DATASETS.c.owner == owner, DATASETS.c.name == name))
        .mappings()
        .first()
    )


def list_rows(conn: Connection, principal: Principal, owner: str | None, limit: int) -> list[Any]:
    stmt = select(DATASETS).order_by(DATASETS.c.created_at.desc(), DATASETS.c.id).limit(limit)
    if not principal.admin:
        stmt = stmt.where(DATASETS.c.owner == principal.name)
    elif owner is not None:
        stmt = stmt.where(DATASETS.c.owner == owner)
    return list(conn.execute(stmt).mappings())


def begin_upload(
    sessions: sessionmaker[Session],
    data_root: Path,
    *,
    owner: str,
    name: str,
    fmt: str,
    tokenizer: str,
    reserve: int,
    owner_limit: int,
) -> dict[str, Any]:
    """Insert the ``uploading`` row, reserving ``reserve`` bytes of the owner's room
    (service.api.datasets.quota; PayloadTooLarge naming the setting if they do not fit). A
    name already taken is a Conflict, unless that dataset failed: then it is replaced."""
    now = utcnow()
    row = {
        "id": new_job_id(),
        "owner": owner,
        "name": name,
        "status": "uploading",
        "reason": None,
        "format": fmt,
        "tokenizer": tokenizer,
        "path": folder_of(owner, name),
        "bytes": 0,
        "disk_bytes": reserve,
        "documents": None,
        "train_tokens": None,
        "val_tokens": None,
        "vocab_size": None,
        "report": None,
        "created_at": now,
        "updated_at": now,
        "ready_at": None,
    }
    with sessions() as session, session.begin():
        quota.lock_owner(session, owner)  # first: this owner's uploads one at a time
        old = get_row(session, owner, name)
        if old is not None:
            if old["status"] != "failed":
                raise Conflict(f"dataset {name} already exists ({old['status']}); delete it first")
            session.execute(delete(DATASETS).where(DATASETS.c.id == old["id"]))
        quota.check(session, owner, reserve, owner_limit, exclude=None)
        try:
            session.execute(insert(DATASETS).values(**row))
            session.flush()
        except IntegrityError as exc:  # the same name, uploaded at the same moment
            raise Conflict(f"dataset {name} already exists (uploading); delete it first") from exc
    if old is not None:
        shutil.rmtree(Path(data_root) / old["path"], ignore_errors=True)
        remove_work(data_root, old["id"])
    return row


def set_status(
    sessions: sessionmaker[Session], dataset_id: str, expected: str, **values: Any
) -> bool:
    """Compare-and-set: the dataset moves on only from ``expected``; False if it had not."""
    values.setdefault("updated_at", utcnow())
    with sessions() as session, session.begin():
        done = session.execute(
            update(DATASETS)
            .where(DATASETS.c.id == dataset_id, DATASETS.c.status == expected)
            .values(**values)
        )
        return bool(done.rowcount)  # type: ignore[attr-defined]


def forget(sessions: sessionmaker[Session], dataset_id: str) -> None:
    with sessions() as session, session.begin():
        session.execute(delete(DATASETS).where(DATASETS.c.id == dataset_id))


def heartbeat(sessions: sessionmaker[Session], progress: dict[str, int | None]) -> None:
    """Fresh ``updated_at`` for the datasets this process works on (and bytes received)."""
    now = utcnow()
    with sessions() as session, session.begin():
        for dataset_id, received in progress.items():
            values: dict[str, Any] = {"updated_at": now}
            if received is not None:
                values["bytes"] = received
            session.execute(
                update(DATASETS)
                .where(DATASETS.c.id == dataset_id, DATASETS.c.status.in_(ACTIVE))
                .values(**values)
            )


def jobs_using(conn: Connection | Session, owner: str, name: str, limit: int = 5) -> list[str]:
    """The owner's queued, running or cancelling jobs that read dataset ``name``: their
    frozen ``data.dataset`` (only a job of the dataset's owner can name it, and the
    comparison is of the validated name, not of a path's spelling)."""
    used = JOBS.c.train[("data", "dataset")].as_string()
    stmt = (
        select(JOBS.c.id)
        .where(JOBS.c.owner == owner, JOBS.c.status.in_(ACTIVE_JOBS), used == name)
        .order_by(JOBS.c.id)
        .limit(limit)
    )
    return [r[0] for r in conn.execute(stmt)]


def reap_stale(sessions: sessionmaker[Session], data_root: Path, stale_s: float) -> int:
    """Fail the datasets whose uploading or preparing process stopped beating; remove their
    work files. (The upload is gone with its connection, so there is nothing to re-run.)"""
    cutoff = utcnow() - timedelta(seconds=stale_s)
    with sessions() as session:
        rows = list(
            session.execute(
                select(DATASETS.c.id, DATASETS.c.status).where(
                    DATASETS.c.status.in_(ACTIVE), DATASETS.c.updated_at < cutoff
                )
            )
        )
    reaped = 0
    for r in rows:
        why = (
            f"the API process {'receiving' if r.status == 'uploading' else 'preparing'} it"
            f" stopped (no heartbeat for {stale_s:g}s); upload it again"
        )
        if set_status(sessions, r.id, r.status, status="failed", reason=why, disk_bytes=0):
            remove_work(data_root, r.id)
            reaped += 1
    return reaped


# -- jobs -----------------------------------------------------------------------------------


def _model_vocab(spec: JobSpec, data_root: Path) -> tuple[int | None, str]:
    model = spec.train.model
    if not isinstance(model, HFModelConfig):
        return model.vocab_size, f"train.model.{model.family}.vocab_size"
    try:  # the hf family's vocab is its config.json's; the trainer checks it again anyway
        folder = resolve_data_path(model.path, data_root, field="train.model.path")
        cfg = json.loads(read_plain(folder / "config.json", limit=1 << 20))
        vocab = cfg.get("vocab_size")
    except (OSError, ValueError, ConfigError):
        return None, ""
    ok = isinstance(vocab, int) and not isinstance(vocab, bool)
    return (vocab if ok else None), "the vocab_size of train.model.hf.path's config.json"


def resolve_dataset(reader: Any, data_root: Path, principal: Principal, spec: JobSpec) -> JobSpec:
    """The spec with ``train.data.path`` set to the folder of its ``train.data.dataset``,
    the submitting owner's; InvalidInput naming ``train.data.dataset`` if it cannot run."""
    name = spec.train.data.dataset
    assert name is not None
    loc: list[str | int] = ["body", "train", "data", "dataset"]
    with reader.connect() as conn:
        row = get_row(conn, principal.name, name)
    if row is None:
        raise InvalidInput.at(loc, f"dataset {name} not found (or not yours)")
    if row["status"] != "ready":
        why = f" ({row['reason']})" if row["reason"] else ""
        raise InvalidInput.at(loc, f"dataset {name} is {row['status']}{why}, not ready")
    vocab, field = _model_vocab(spec, data_root)
    if vocab is not None and row["vocab_size"] is not None and row["vocab_size"] > vocab:
        raise InvalidInput.at(
            loc,
            f"dataset {name} has vocab size {row['vocab_size']}, larger than the model's"
            f" {vocab} ({field}); its token ids would index past the embedding",
        )
    if spec.train.data.packing:
        _check_packing(row, spec)
    data = spec.train.data.model_copy(update={"path": row["path"]})
    return spec.model_copy(update={"train": spec.train.model_copy(update={"data": data})})


def _check_packing(row: Any, spec: JobSpec) -> None:
    """``train.data.packing`` needs a chat or completion dataset (the examples' boundaries);
    with ``overlong: drop`` (the default), every example must fit ``seq_len + 1`` tokens, else
    the run would leave examples out that the dataset kept: InvalidInput naming the field."""
    name, report = row["name"], row["report"] if isinstance(row["report"], dict) else {}
    if row["format"] not in ("chat", "completion"):
        raise InvalidInput.at(
            ["body", "train", "data", "packing"],
            f"dataset {name} is {row['format']} data: packing needs a chat or completion"
            " dataset, whose examples' boundaries it keeps",
        )
    longest, seq_len = report.get("longest"), spec.train.model.seq_len
    if isinstance(longest, int) and report.get("overlong") == "drop" and longest > seq_len + 1:
        raise InvalidInput.at(
            ["body", "train", "model", "seq_len"],
            f"dataset {name}'s longest example is {longest} tokens, more than seq_len + 1 ="
            f" {seq_len + 1}: packed, it would be dropped (the dataset's overlong=drop); use"
            f" seq_len >= {longest - 1}, or a dataset uploaded with max_len <= {seq_len + 1}"
            " or overlong=truncate",
        )
