"""A job's checkpoints: list them, download one as a tar (native, or the Hugging Face folder).

The files are on the storage the workers write (``TRAINQ_RUNS_ROOT``, shared); the API
reads them (``service.api.checkpoints.files``) and streams them (``service.api.checkpoints.tar``),
and never loads torch or converts anything: the trainer wrote the hf folder (trainer.publish).
"""

from __future__ import annotations

import os
from typing import Annotated, Any

from fastapi import APIRouter, Header, Path, Query, Response
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from service.api.checkpoints.files import (
    CheckpointList,
    Format,
    checkpoint_list,
    checkpoints_dir,
    export_failure,
    open_format,
    resolve_step,
    scan_checkpoints,
)
from service.api.checkpoints.tar import Archive, ArchiveChanged, parse_range
from service.api.core.auth import Principal
from service.api.core.deps import PrincipalDep, Services, ServicesDep
from service.api.core.errors import Conflict, NotFound
from service.api.core.inputs import JobId
from service.api.core.responses import errors
from service.api.jobs import crud

__all__ = ["router"]

router = APIRouter(tags=["checkpoints"])

StepParam = Annotated[
    str,
    Path(
        pattern=r"^(latest|[0-9]{1,10})$",
        max_length=10,
        description="a checkpoint's step, or latest",
    ),
]
_ERRORS = errors(401, 404)
_ERRORS[409] = {
    "description": "the checkpoint has no folder of that format (its export failed, with the "
    "reason; or none was written: download format=native)",
    "model": _ERRORS[404]["model"],
}


def _require(services: Services, principal: Principal, job_id: str) -> None:
    with services.reader.connect() as session:
        if not crud.job_exists(session, principal, job_id):
            raise NotFound(f"job {job_id} not found")


def _list(services: Services, principal: Principal, job_id: str) -> CheckpointList:
    _require(services, principal, job_id)
    found = scan_checkpoints(services.settings.runs_root, job_id)  # no connection held
    with services.reader.connect() as session:
        return checkpoint_list(session, job_id, found)


@router.get(
    "/v1/jobs/{job_id}/checkpoints", response_model=CheckpointList, responses=errors(401, 404)
)
async def job_checkpoints(
    job_id: JobId, services: ServicesDep, principal: PrincipalDep
) -> Response:
    """The job's complete checkpoints, oldest first: step, time, tokens seen, train and val
    loss at that step, size, strategy, whether it is the latest, the formats it downloads as,
    and its exports (hf, peft: ready with their size, or failed with the reason)."""
    out = await run_in_threadpool(_list, services, principal, job_id)
    return Response(out.model_dump_json(), media_type="application/json")


def _archive(
    services: Services, principal: Principal, job_id: str, step: str, fmt: Format
) -> tuple[int, Archive]:
    """The chosen checkpoint's archive with its files open (NotFound, Conflict)."""
    _require(services, principal, job_id)
    ck_fd = checkpoints_dir(services.settings.runs_root, job_id)
    if ck_fd is None:
        raise NotFound(f"job {job_id} has no checkpoint yet")
    try:
        found = resolve_step(ck_fd, None if step == "latest" else int(step))
        if found is None:
            what = "no checkpoint yet" if step == "latest" else f"no checkpoint at step {step}"
            raise NotFound(f"job {job_id} has {what}")
        opened = open_format(ck_fd, found, fmt)
        if opened is None and fmt != "native" and _exists(ck_fd, found):
            raise Conflict(_no_export(ck_fd, job_id, found, fmt))
        if opened is None:
            raise NotFound(f"job {job_id} has no checkpoint at step {found} (pruned)")
    finally:
        os.close(ck_fd)
    archive = Archive(*opened)
    try:
        archive.open_files()
    except ArchiveChanged:
        archive.close()
        raise NotFound(f"job {job_id} has no checkpoint at step {found} (pruned)") from None
    return found, archive


def _no_export(ck_fd: int, job_id: str, step: int, fmt: str) -> str:
    """Why checkpoint ``step`` has no ``fmt`` folder, and what to do instead."""
    what = f"checkpoint step {step} of job {job_id}"
    reason = export_failure(ck_fd, step, fmt)
    if reason is not None:
        return f"the {fmt} export of {what} failed: {reason}"
    if fmt == "peft":
        return (
            f"{what} has no PEFT adapter: the trainer writes one beside the hf folder for a "
            "LoRA run; download format=native into DIR and convert it: `python -m "
            "trainer.export --run-dir DIR --checkpoint DIR --format peft --out OUT`"
        )
    return (
        f"{what} has no Hugging Face folder: the trainer writes one for a finished run's "
        "last checkpoint (every checkpoint with train.checkpoint.hf: every); download "
        "format=native into DIR and convert it: `python -m trainer.export --run-dir DIR "
        "--checkpoint DIR --format hf --out OUT`"
    )


def _exists(ck_fd: int, step: int) -> bool:
    native = open_format(ck_fd, step, "native")
    if native is None:
        return False
    os.close(native[0])
    return True


class _ArchiveResponse(StreamingResponse):
    """Closes the archive's files however the response ends (sent, cut, never started).
    A file that changed mid-stream (logged by the archive) ends the response unfinished:
    the server closes the connection, and the client has fewer bytes than Content-Length."""

    def __init__(self, archive: Archive, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.archive = archive

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        except ArchiveChanged:
            return  # no traceback: the server says "returned without completing response"
        finally:
            self.archive.close()


_DOWNLOAD = "/v1/jobs/{job_id}/checkpoints/{step}/download"
FormatParam = Annotated[
    Format,
    Query(
        description="native: the trainer's files; hf: the Hugging Face folder; peft: a LoRA "
        "run's adapter as PEFT writes it"
    ),
]
RangeHeader = Annotated[str | None, Header(alias="range", max_length=200)]
IfRangeHeader = Annotated[str | None, Header(max_length=200)]


@router.get(
    _DOWNLOAD,
    response_class=StreamingResponse,
    responses={
        200: {"content": {"application/x-tar": {"schema": {"type": "string"}}}},
        206: {"description": "the byte range asked for (Range)"},
        416: {"description": "the range is past the end of the archive"},
        **_ERRORS,
    },
)
async def download_checkpoint(
    job_id: JobId,
    step: StepParam,
    services: ServicesDep,
    principal: PrincipalDep,
    format: FormatParam = "native",
    range_: RangeHeader = None,
    if_range: IfRangeHeader = None,
) -> Response:
    """A checkpoint as a tar archive streamed from its files (no copy made): ``native`` (what
    a resume and ``trainer.export --checkpoint`` read), ``hf`` (config.json,
    model.safetensors and the tokenizer for ``transformers``' from_pretrained) or ``peft``
    (a LoRA run's adapter_config.json and adapter_model.safetensors for
    ``PeftModel.from_pretrained``). An export that failed is a 409 with its reason.
    ``latest`` names the newest.
    Member names are relative (``tar -x -C DIR``); Content-Length is exact, and a single
    ``Range`` (with ``If-Range`` and the ETag) resumes a download."""
    return await _download(services, principal, job_id, step, format, range_, if_range)


@router.head(_DOWNLOAD, responses={200: {"description": "the download's headers"}, **_ERRORS})
async def head_checkpoint(
    job_id: JobId,
    step: StepParam,
    services: ServicesDep,
    principal: PrincipalDep,
    format: FormatParam = "native",
    range_: RangeHeader = None,
    if_range: IfRangeHeader = None,
) -> Response:
    """The download's status and headers (Content-Length, ETag, Accept-Ranges), no body."""
    return await _download(services, principal, job_id, step, format, range_, if_range, head=True)


async def _download(
    services: Services,
    principal: Principal,
    job_id: str,
    step: str,
    fmt: Format,
    range_: str | None,
    if_range: str | None,
    *,
    head: bool = False,
) -> Response:
    """GET's answer; with ``head`` the same status and headers, the archive closed unread."""
    found, archive = await run_in_threadpool(_archive, services, principal, job_id, step, fmt)
    etag = archive.etag
    headers = {
        "Content-Disposition": f'attachment; filename="{job_id}-step-{found}-{fmt}.tar"',
        "Accept-Ranges": "bytes",
        "ETag": etag,
        "X-Trainq-Step": str(found),
        "Cache-Control": "no-store",
    }
    wanted = parse_range(range_, archive.size) if if_range in (None, etag) else None
    if wanted is False:
        archive.close()
        headers["Content-Range"] = f"bytes */{archive.size}"
        return Response(status_code=416, headers=headers)
    start, stop = wanted if isinstance(wanted, tuple) else (0, archive.size)
    headers["Content-Length"] = str(stop - start)
    status = 200
    if isinstance(wanted, tuple):
        status = 206
        headers["Content-Range"] = f"bytes {start}-{stop - 1}/{archive.size}"
    if head:
        archive.close()
        return Response(status_code=status, headers=headers, media_type="application/x-tar")
    return _ArchiveResponse(
        archive,
        content=archive.body(start, stop),
        status_code=status,
        headers=headers,
        media_type="application/x-tar",
    )
