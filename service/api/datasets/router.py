"""Datasets: upload (streamed), list, get, delete. See service.api.datasets.service for the
model."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import AsyncIterator
from pathlib import Path as FsPath
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request, Response
from sqlalchemy import delete
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from service.api.core.auth import Principal
from service.api.core.deps import PrincipalDep, Services, ServicesDep
from service.api.core.errors import Conflict, InvalidInput, NotFound, PayloadTooLarge, TrainqError
from service.api.core.models import DATASETS
from service.api.core.responses import errors
from service.api.datasets import quota
from service.api.datasets import service as datasets
from service.api.datasets.service import ACTIVE, DatasetList, DatasetOut, Format, Overlong
from service.api.datasets.upload import Refused, UploadSink, make_check
from service.api.datasets.work import DatasetWork
from trainer.sft_lines import SFT_FORMATS

__all__ = ["UPLOAD_PATH", "router"]

router = APIRouter(tags=["datasets"])

UPLOAD_PATH = "/v1/datasets"
# Bytes gathered from the connection before one write (and check) on a worker thread.
FLUSH_BYTES = 1 << 20

DatasetName = Annotated[str, Path(min_length=1, max_length=64)]
OwnerQuery = Annotated[
    str | None,
    Query(
        min_length=1,
        max_length=128,
        description="an admin token's view of another owner's dataset (default: your own)",
    ),
]

_BODY = {
    "requestBody": {
        "required": True,
        "description": "the corpus: UTF-8 text, JSON Lines with a text field per line, JSON"
        " Lines of conversations (chat) or prompt/completion pairs (completion), or llm.c"
        " shards back to back (`curl --data-binary @corpus.txt`)",
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    }
}


def _json(model: Any, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status, media_type="application/json")


def _owner_text(owner: str | None) -> None:
    if owner is not None and "\x00" in owner:
        raise InvalidInput.at(["query", "owner"], "must not contain NUL (U+0000) characters")


def _owner(principal: Principal, owner: str | None, name: str) -> str:
    """Whose dataset ``name`` is meant: your own, or (an admin) the owner named."""
    _owner_text(owner)
    if owner is None or owner == principal.name:
        return principal.name
    if not principal.admin:
        raise NotFound(f"dataset {name} not found")
    return owner


def _over(what: str, limit: int, setting: str) -> PayloadTooLarge:
    return PayloadTooLarge(f"{what}, over the limit of {limit} bytes ({setting})")


@router.post(
    UPLOAD_PATH,
    status_code=202,
    response_model=DatasetOut,
    responses={
        **errors(401, 409),
        408: {
            "description": "the upload's body stalled (TRAINQ_DATASET_UPLOAD_IDLE_S), or"
            " did not end in time (TRAINQ_DATASET_UPLOAD_MAX_S)",
            "model": errors(401)[401]["model"],
        },
    },
    openapi_extra=_BODY,
)
async def upload_dataset(
    request: Request,
    services: ServicesDep,
    principal: PrincipalDep,
    name: Annotated[str, Query(min_length=1, max_length=64, description="unique per owner")],
    format: Annotated[Format, Query(description="text, jsonl, bin, chat or completion")] = "text",
    tokenizer: Annotated[
        str,
        Query(
            min_length=1,
            max_length=1024,
            description="byte, or a Hugging Face tokenizer.json (or its folder) under the"
            " data root",
        ),
    ] = "byte",
    vocab_size: Annotated[
        int | None,
        Query(ge=2, le=65536, description="bin only: the shards' vocab (byte: 256)"),
    ] = None,
    val_fraction: Annotated[
        float, Query(ge=0, lt=1, description="the last share of the tokens, for validation")
    ] = 0.1,
    max_len: Annotated[
        int | None,
        Query(
            ge=1,
            le=1 << 24,
            description="chat, completion: the tokens an example may have after templating"
            " (default: no limit)",
        ),
    ] = None,
    overlong: Annotated[
        Overlong | None,
        Query(
            description="chat, completion: an example past max_len is dropped (default)"
            " or truncated"
        ),
    ] = None,
    train_on_inputs: Annotated[
        bool | None,
        Query(description="chat, completion: every token carries loss, not only the answers"),
    ] = None,
) -> Response:
    """Upload a corpus (the body, streamed to disk and checked as it comes); 202 with the
    dataset, ``preparing``: poll it until ``ready`` (or ``failed``, with a reason). A bad
    corpus is a 422 naming what is wrong (the byte offset, the line, the shard); over a size
    limit, 413 naming it; nothing of a refused upload is kept."""
    settings = services.settings
    deadline = asyncio.get_running_loop().time() + settings.dataset_upload_max_s
    data_root = FsPath(settings.data_root)
    datasets.check_name(name, ["query", "name"])
    stored, tok_file = await run_in_threadpool(datasets.resolve_tokenizer, data_root, tokenizer)
    tok_bytes = 0 if tok_file is None else (await run_in_threadpool(tok_file.stat)).st_size
    if format != "bin" and vocab_size is not None:
        raise InvalidInput.at(["query", "vocab_size"], "vocab_size goes with format bin only")
    if format == "bin" and vocab_size is None and tok_file is not None:
        raise InvalidInput.at(
            ["query", "vocab_size"], "format bin with a Hugging Face tokenizer needs vocab_size"
        )
    vocab = vocab_size or 256
    options = _sft_options(format, max_len, overlong, train_on_inputs)
    limit = settings.dataset_max_upload_bytes
    declared = request.headers.get("content-length")
    size = int(declared) if declared and declared.isdigit() else 0
    if size > limit:
        raise _over(f"the upload is {size} bytes", limit, "TRAINQ_DATASET_MAX_UPLOAD_BYTES")
    # The owner's room is reserved for what this upload becomes once prepared: for the
    # declared length now, for the bytes received as they come (service.api.datasets.quota).
    covered = size

    def reserve(received: int) -> int:
        return quota.prepared_bound(format, received, tok_bytes)

    async def cover(received: int) -> None:
        """Reserve room for ``received`` bytes before they are written (413 if none)."""
        nonlocal covered
        if received > covered:
            covered = received
            row["disk_bytes"] = reserve(received)
            await run_in_threadpool(
                quota.reserve,
                services.sessions,
                dataset_id,
                principal.name,
                row["disk_bytes"],
                settings.dataset_max_owner_bytes,
            )

    row = await run_in_threadpool(
        lambda: datasets.begin_upload(
            services.sessions,
            data_root,
            owner=principal.name,
            name=name,
            fmt=format,
            tokenizer=stored,
            reserve=reserve(size),
            owner_limit=settings.dataset_max_owner_bytes,
        )
    )
    work: DatasetWork = request.app.state.datasets
    dataset_id = row["id"]
    upload, _ = datasets.work_paths(data_root, dataset_id)
    work.track_upload(dataset_id)
    sink: UploadSink | None = None
    writing: asyncio.Future[None] | None = None
    try:
        await work.warm(row, tok_file, vocab, val_fraction, options)
        sink = await run_in_threadpool(UploadSink, upload, make_check(format, vocab))
        # One buffer written (and checked) on a worker thread while the next one arrives.
        buf, received = bytearray(), 0
        async for chunk in _bounded(
            request, settings.dataset_upload_idle_s, settings.dataset_upload_max_s, deadline
        ):
            buf += chunk
            received += len(chunk)
            if received > limit:
                raise _over(
                    f"the upload passed {limit} bytes", limit, "TRAINQ_DATASET_MAX_UPLOAD_BYTES"
                )
            if len(buf) >= FLUSH_BYTES:
                await cover(received)
                if writing is not None:
                    await writing
                data, buf = bytes(buf), bytearray()
                writing = asyncio.ensure_future(run_in_threadpool(sink.write, data))
                work.uploading[dataset_id] = received
        if writing is not None:
            await writing
        await cover(received)
        if buf:
            await run_in_threadpool(sink.write, bytes(buf))
        documents = await run_in_threadpool(sink.finish)
    except BaseException as exc:
        if writing is not None:  # the thread finishes its write before the file goes
            with contextlib.suppress(BaseException):
                await asyncio.shield(writing)
        await work.cool(dataset_id)
        await run_in_threadpool(_discard, services, sink, upload, dataset_id)
        if isinstance(exc, Refused):
            raise InvalidInput.at(["body"], f"{format} upload: {exc}") from None
        if isinstance(exc, ClientDisconnect):
            return Response(status_code=400)  # nobody is listening
        raise
    finally:
        work.untrack_upload(dataset_id)
    values = {"status": "preparing", "bytes": sink.received, "documents": documents}
    if not await run_in_threadpool(
        lambda: datasets.set_status(services.sessions, dataset_id, "uploading", **values)
    ):
        await work.cool(dataset_id)
        await run_in_threadpool(datasets.remove_work, data_root, dataset_id)
        raise Conflict(f"dataset {name} was failed while it uploaded (see its reason)")
    row.update(values)
    work.start_prepare(row, tok_file, vocab, val_fraction, options)
    return _json(datasets.dataset_out(row), 202)


def _sft_options(
    fmt: str, max_len: int | None, overlong: str | None, train_on_inputs: bool | None
) -> list[str]:
    """The preparation's options of a chat or completion upload (service.api.datasets.
    prepare's argv); a 422 naming the option given with another format."""
    given = {"max_len": max_len, "overlong": overlong, "train_on_inputs": train_on_inputs}
    if fmt not in SFT_FORMATS:
        for field, value in given.items():
            if value is not None:
                raise InvalidInput.at(
                    ["query", field], f"{field} goes with format chat or completion only"
                )
        return []
    options = ["--overlong", overlong or "drop"]
    if max_len is not None:
        options += ["--max-len", str(max_len)]
    if train_on_inputs:
        options.append("--train-on-inputs")
    return options


class UploadTimeout(TrainqError):
    status_code = 408


async def _bounded(
    request: Request, idle_s: float, max_s: float, deadline: float
) -> AsyncIterator[bytes]:
    """The body's chunks; an upload that sends nothing for ``idle_s``, or is not over by
    ``deadline`` (the loop's clock: ``max_s`` after the upload began) however steadily it
    sends (a slow client holding a row, a
    reservation and a preparation child), ends with a 408 naming the setting."""
    loop = asyncio.get_running_loop()
    chunks = request.stream().__aiter__()
    while True:
        left = deadline - loop.time()
        try:
            if left <= 0:
                raise TimeoutError
            chunk = await asyncio.wait_for(anext(chunks), min(idle_s, left))
        except StopAsyncIteration:
            return
        except TimeoutError:
            if loop.time() >= deadline:
                raise UploadTimeout(
                    f"the upload did not end within {max_s:g} s (TRAINQ_DATASET_UPLOAD_MAX_S)"
                ) from None
            raise UploadTimeout(
                f"the upload sent nothing for {idle_s:g} s (TRAINQ_DATASET_UPLOAD_IDLE_S)"
            ) from None
        yield chunk


def _discard(services: Services, sink: UploadSink | None, upload: FsPath, dataset_id: str) -> None:
    """A refused or broken upload leaves nothing: no file, no row."""
    if sink is not None:
        sink.abort()
    upload.unlink(missing_ok=True)
    datasets.forget(services.sessions, dataset_id)


@router.get("/v1/datasets", response_model=DatasetList, responses=errors(401))
def list_datasets(
    services: ServicesDep,
    principal: PrincipalDep,
    owner: Annotated[
        str | None, Query(min_length=1, max_length=128, description="admin: one owner's only")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 200,
) -> Response:
    """Your datasets, newest first (an admin token: everyone's)."""
    _owner_text(owner)
    with services.reader.connect() as conn:
        rows = datasets.list_rows(conn, principal, owner, limit)
    return _json(DatasetList(items=[datasets.dataset_out(r) for r in rows]))


@router.get("/v1/datasets/{name}", response_model=DatasetOut, responses=errors(401, 404))
def get_dataset(
    name: DatasetName, services: ServicesDep, principal: PrincipalDep, owner: OwnerQuery = None
) -> Response:
    """One dataset: status, reason, counts (documents, train/val tokens, vocab), folder."""
    datasets.check_name(name, ["path", "name"])
    with services.reader.connect() as conn:
        row = datasets.get_row(conn, _owner(principal, owner, name), name)
    if row is None:
        raise NotFound(f"dataset {name} not found")
    return _json(datasets.dataset_out(row))


@router.delete(
    "/v1/datasets/{name}", status_code=204, responses=errors(401, 404, 409), response_class=Response
)
def delete_dataset(
    name: DatasetName, services: ServicesDep, principal: PrincipalDep, owner: OwnerQuery = None
) -> Response:
    """Delete a dataset and its folder; 409 while it uploads or prepares, or while a queued
    or running job reads it."""
    datasets.check_name(name, ["path", "name"])
    who = _owner(principal, owner, name)
    with services.sessions() as session, session.begin():
        row = datasets.get_row(session, who, name)
        if row is None:
            raise NotFound(f"dataset {name} not found")
        if row["status"] in ACTIVE:
            raise Conflict(f"dataset {name} is {row['status']}; delete it once it is done")
        using = datasets.jobs_using(session, who, name)
        if using:
            raise Conflict(
                f"dataset {name} is used by job(s) {', '.join(using)} (queued or running);"
                " cancel them or wait for them to end"
            )
        session.execute(delete(DATASETS).where(DATASETS.c.id == row["id"]))
    shutil.rmtree(FsPath(services.settings.data_root) / row["path"], ignore_errors=True)
    return Response(status_code=204)
