"""``trainq checkpoints ID`` and ``trainq download ID -o DIR``: a job's checkpoints out.

The archive (``GET /v1/jobs/{id}/checkpoints/{step}/download``, a tar) is extracted while it
streams in, never held whole in memory or written to disk as an archive: into a temporary
folder beside DIR (tarfile's ``data`` filter: no absolute names, no ``..``, no links out, no
devices, modes made safe), checked against the Content-Length the server announced, then
moved into DIR. A cut download leaves DIR as it was. DIR must be empty or absent unless
``--force`` (then files of the same name are replaced). Every failure is one line.
"""

from __future__ import annotations

import json
import os
import shutil
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from service.cli.base import cli_errors
from service.cli.output import clean, fmt, table, when

if TYPE_CHECKING:
    from service.cli.client import Client

__all__ = ["download", "register"]

READ_TIMEOUT_S = 300.0  # one chunk's wait; a long download is fine, a stuck one is not


class _Stream:
    """A file-like ``read(n)`` over the response's byte chunks, counting them."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._buf = bytearray()
        self._pos = 0
        self.count = 0

    def read(self, n: int = -1) -> bytes:
        while n < 0 or len(self._buf) - self._pos < n:
            chunk = next(self._chunks, None)
            if chunk is None:
                break
            del self._buf[: self._pos]  # once per chunk, not per read
            self._pos = 0
            self._buf += chunk
            self.count += len(chunk)
        end = len(self._buf) if n < 0 else min(len(self._buf), self._pos + n)
        out = bytes(self._buf[self._pos : end])
        self._pos = end
        return out


def _formats(item: dict[str, Any]) -> str:
    """``native,hf``, with a failed export as ``hf:failed`` (its reason: --json)."""
    shown = [str(f) for f in item.get("formats") or []]
    exports = item.get("exports")
    if not isinstance(exports, dict):
        exports = {}
    shown += [
        f"{name}:failed"
        for name, e in exports.items()
        if isinstance(e, dict) and e.get("status") == "failed"
    ]
    return clean(",".join(shown))


def _size(value: Any) -> str:
    if not isinstance(value, int):
        return "-"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def _checked_out_dir(out: Path, force: bool) -> Path:
    from service.cli.client import BadSetting

    if out.exists() and not out.is_dir():
        raise BadSetting(f"-o {out}: is a file, not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise BadSetting(f"-o {out}: the folder is not empty (pass --force to write into it)")
    return out


def _move_into(src: Path, dst: Path) -> None:
    """Everything in ``src`` into ``dst`` (made if absent), replacing what has the same name."""
    if not dst.exists():
        src.rename(dst)
        return
    for item in sorted(src.iterdir()):
        target = dst / item.name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()
        item.rename(target)


def download(
    client: Client, job_id: str, step: str, fmt_: str, out: Path, *, force: bool = False
) -> tuple[int, int]:
    """Stream the archive into ``out``; (the checkpoint's step, bytes received)."""
    from service.cli.client import ClientError, Unreachable

    _checked_out_dir(out, force)
    parent = out.absolute().parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.part-", dir=parent))
    mask = os.umask(0)
    os.umask(mask)
    tmp.chmod(0o777 & ~mask)  # mkdtemp's 0700 would become DIR's mode: a plain mkdir's instead
    try:
        with client.download(job_id, step, fmt_, read_timeout=READ_TIMEOUT_S) as archive:
            total, got = archive.size, archive.step
            stream = _Stream(archive.chunks)
            try:
                with tarfile.open(fileobj=stream, mode="r|") as tar:  # type: ignore[call-overload]
                    tar.extractall(tmp, filter="data")
                while stream.read(1 << 16):  # the end-of-archive padding
                    pass
            except Unreachable as exc:
                raise Unreachable(
                    f"the download of job {job_id}'s checkpoint was cut off after "
                    f"{stream.count:,} of {total:,} bytes ({exc.__cause__}); run the command again"
                ) from exc
            except (tarfile.TarError, OSError) as exc:
                raise ClientError(f"cannot extract the checkpoint into {out}: {exc}") from exc
            if total >= 0 and stream.count != total:
                raise Unreachable(
                    f"the download of job {job_id}'s checkpoint ended after {stream.count:,} "
                    f"of {total:,} bytes; run the command again"
                )
        _move_into(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return got, stream.count


def register(app: typer.Typer) -> None:
    """Add ``checkpoints`` and ``download`` to the ``trainq`` app."""

    @app.command("checkpoints")
    @cli_errors
    def checkpoints(
        job_id: Annotated[str, typer.Argument(metavar="ID")],
        as_json: Annotated[bool, typer.Option("--json", help="the API's JSON")] = False,
    ) -> None:
        """A job's complete checkpoints: step, losses, size, formats (hf: a Hugging Face folder)."""
        from service.cli.client import Client

        with Client() as client:
            out = client.checkpoints(job_id)
        if as_json:
            typer.echo(json.dumps(out, indent=2))
            return
        rows = [
            [
                str(c.get("step")) + (" *" if c.get("latest") else ""),
                when(c.get("time")),
                f"{c['tokens_seen']:,}" if isinstance(c.get("tokens_seen"), int) else "-",
                fmt(c.get("loss"), ".4f"),
                fmt(c.get("val_loss"), ".4f"),
                _size(c.get("size_bytes")),
                fmt(c.get("strategy")),
                _formats(c),
            ]
            for c in out.get("items", [])
        ]
        header = ["STEP", "TIME", "TOKENS", "LOSS", "VAL_LOSS", "SIZE", "STRATEGY", "FORMATS"]
        typer.echo(table(rows, header) if rows else f"job {clean(job_id)} has no checkpoint yet")

    @app.command("download")
    @cli_errors
    def download_cmd(
        job_id: Annotated[str, typer.Argument(metavar="ID")],
        out: Annotated[Path, typer.Option("-o", "--out", help="folder to write the files into")],
        step: Annotated[
            str, typer.Option("--step", help="a checkpoint's step, or latest")
        ] = "latest",
        format_: Annotated[
            str,
            typer.Option(
                "--format",
                help="native (the trainer's files), hf (a Hugging Face folder) or peft (a "
                "LoRA run's adapter)",
            ),
        ] = "native",
        force: Annotated[
            bool, typer.Option("--force", help="write into a folder that is not empty")
        ] = False,
    ) -> None:
        """Download a checkpoint into a folder: --format hf loads with transformers'
        from_pretrained(DIR); peft with PeftModel.from_pretrained(base, DIR); native with
        `python -m trainer.export --checkpoint DIR`."""
        from service.cli.client import BadSetting, Client

        if step != "latest" and not (step.isascii() and step.isdigit()):
            raise BadSetting(f"--step: {step!r} is not a step number or latest")
        if format_ not in ("native", "hf", "peft"):
            raise BadSetting(f"--format: {format_!r} is not native, hf or peft")
        with Client() as client:
            got, size = download(client, job_id, step, format_, out, force=force)
        what = f"step {got} of job {job_id} ({format_}, {_size(size)})"
        typer.echo(f"downloaded {clean(what)} to {clean(os.fspath(out))}")
