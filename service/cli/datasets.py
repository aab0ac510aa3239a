"""``trainq data upload | list | show | rm``: datasets over the API (POST /v1/datasets ...).

``register(data_app)`` adds them to the ``trainq data`` group (``service.cli.commands``). The
upload streams the file from disk in chunks (never read whole), with a progress bar on a
terminal, and checks each chunk as the server will (``service.api.datasets.upload``, which
imports the standard library only, and numpy for ``bin``), so a bad file stops at once with
the server's own message. ``--wait`` polls the dataset until it is ``ready`` or ``failed``.
Every error is one line (``service.cli.base.cli_errors``).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from service.cli.output import clean, fmt, table, when

if TYPE_CHECKING:
    from service.cli.client import Client

__all__ = ["register"]

CHUNK = 1 << 20
POLL_S = 0.5
_FORMATS = {".jsonl": "jsonl", ".bin": "bin"}


class _Bar:
    """``uploading NAME  12.0/100.0 MB  12%  85.3 MB/s`` rewritten in place on a terminal."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total = label, total
        self.live = sys.stderr.isatty()
        self.start = time.monotonic()
        self._shown = 0.0

    def update(self, done: int, final: bool = False) -> None:
        now = time.monotonic()
        if not self.live or (not final and now - self._shown < 0.1):
            return
        self._shown = now
        rate = done / max(now - self.start, 1e-6) / 1e6
        share = f"{100 * done / self.total:.0f}%" if self.total else "-"
        line = f"uploading {self.label}  {done / 1e6:.1f}/{self.total / 1e6:.1f} MB  {share}"
        sys.stderr.write(f"\r\x1b[K{clean(line)}  {rate:.1f} MB/s")
        if final:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _chunks(path: Path, fmt_: str, vocab: int, bar: _Bar) -> Iterator[bytes]:
    """The file in chunks, each checked as the server checks it (Refused: stop now)."""
    from service.api.datasets.upload import JsonlCheck, SftCheck, make_check

    check = make_check(fmt_, vocab)
    sent = 0
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            check.feed(chunk)
            sent += len(chunk)
            bar.update(sent)
            yield chunk
    if isinstance(check, JsonlCheck | SftCheck):
        check.last()
    check.finish()
    bar.update(sent, final=True)


def _upload(client: Client, path: Path, params: dict[str, Any], vocab: int) -> dict[str, Any]:
    from service.api.datasets.upload import Refused
    from service.cli.client import Invalid

    size = path.stat().st_size
    bar = _Bar(path.name, size)
    try:
        return client.upload_dataset(params, _chunks(path, params["format"], vocab, bar), size)
    except Refused as exc:
        raise Invalid(f"{path}: {params['format']} upload: {exc}", 422) from None


def _line(d: dict[str, Any]) -> str:
    text = f"dataset {d.get('name')} {d.get('status')}"
    if d.get("status") == "ready":
        text += (
            f": {d.get('train_tokens')} train and {d.get('val_tokens')} val tokens, vocab"
            f" {d.get('vocab_size')}, {d.get('documents')} document(s); train on it with"
            f" train.data.dataset={d.get('name')}"
        )
    elif d.get("reason"):
        text += f": {' '.join(str(d['reason']).split())}"
    lines = [text]
    report = d.get("report")
    if d.get("status") == "ready" and isinstance(report, dict):
        lines += _report_line(report).split("\n")
    return "\n".join(clean(line) for line in lines)  # each cleaned: its own newlines escaped


def _report_line(r: dict[str, Any]) -> str:
    """``12 examples, 3,456 tokens, 21.5% carry loss; dropped: 2 too_long; truncated: 0``,
    then the longest example and the packing a job would get (``trainer.sft.SftReport``)."""
    dropped = r.get("dropped") or {}
    gone = ", ".join(f"{n} {why}" for why, n in dropped.items()) if dropped else "none"
    share = float(r.get("loss_share") or 0.0)
    text = (
        f"{r.get('examples')} examples, {r.get('tokens')} tokens, {100 * share:.1f}% carry"
        f" loss ({r.get('target_tokens')} target tokens); dropped: {gone}; truncated:"
        f" {r.get('truncated', 0)} (max_len {r.get('max_len')}, {r.get('overlong')});"
        f" train_on_inputs {str(bool(r.get('train_on_inputs'))).lower()}, chat template:"
        f" {r.get('chat_template')}"
    )
    if r.get("longest"):  # datasets prepared before these fields have none
        packed = float(r.get("packing_efficiency") or 0.0)
        text += (
            f"\nlongest example {r.get('longest')} tokens; packed (train.data.packing) at"
            f" seq_len {r.get('packing_seq_len')}: {100 * packed:.1f}% of the rows are tokens"
        )
    return text


def register(data_app: typer.Typer) -> None:
    """Add ``upload``, ``list``, ``show`` and ``rm`` to the ``trainq data`` group."""
    from service.cli.base import cli_errors, fail, make_client

    @data_app.command("upload")
    @cli_errors
    def upload(
        file: Annotated[Path, typer.Argument(metavar="FILE", help="the corpus")],
        name: Annotated[str, typer.Option("--name", help="the dataset's name (yours)")],
        format_: Annotated[
            str | None,
            typer.Option(
                "--format",
                help="text, jsonl, bin, chat or completion (default: from the extension,"
                " else text)",
            ),
        ] = None,
        tokenizer: Annotated[
            str,
            typer.Option("--tokenizer", help="byte, or a tokenizer.json under the data root"),
        ] = "byte",
        vocab_size: Annotated[
            int | None, typer.Option("--vocab-size", help="bin: the shards' vocab")
        ] = None,
        val_fraction: Annotated[float, typer.Option("--val-fraction", min=0.0, max=0.99)] = 0.1,
        max_len: Annotated[
            int | None,
            typer.Option("--max-len", min=1, help="chat, completion: tokens an example may have"),
        ] = None,
        overlong: Annotated[
            str | None,
            typer.Option("--overlong", help="chat, completion: drop (default) or truncate"),
        ] = None,
        train_on_inputs: Annotated[
            bool,
            typer.Option("--train-on-inputs", help="chat, completion: loss on every token"),
        ] = False,
        wait: Annotated[
            bool, typer.Option("--wait", help="until ready (exit 1 if it failed)")
        ] = False,
        timeout: Annotated[
            float | None, typer.Option("--timeout", min=1, help="--wait at most S seconds")
        ] = None,
    ) -> None:
        """Upload a corpus as a dataset: streamed, checked, then prepared into shards."""
        if not file.is_file():
            raise fail(f"{file} is not a file", 2)
        fmt_ = format_ or _FORMATS.get(file.suffix.lower(), "text")
        if fmt_ not in ("text", "jsonl", "bin", "chat", "completion"):
            raise fail(f"--format must be text, jsonl, bin, chat or completion, not {fmt_!r}", 2)
        if overlong is not None and overlong not in ("drop", "truncate"):
            raise fail(f"--overlong must be drop or truncate, not {overlong!r}", 2)
        params: dict[str, Any] = {
            "name": name,
            "format": fmt_,
            "tokenizer": tokenizer,
            "val_fraction": val_fraction,
        }
        sft = {"max_len": max_len, "overlong": overlong, "train_on_inputs": train_on_inputs or None}
        params.update({k: v for k, v in sft.items() if v is not None})
        if vocab_size is not None:
            params["vocab_size"] = vocab_size
        vocab = vocab_size or (256 if tokenizer == "byte" else 65536)
        with make_client() as client:
            found = _upload(client, file, params, vocab)
            typer.echo(clean(f"dataset {name} uploaded ({found.get('bytes')} bytes), preparing"))
            if not wait:
                return
            deadline = None if timeout is None else time.monotonic() + timeout
            while found.get("status") in ("uploading", "preparing"):
                if deadline is not None and time.monotonic() > deadline:
                    raise fail(f"gave up waiting after {timeout:g}s: dataset {name} preparing", 4)
                time.sleep(POLL_S)
                found = client.dataset(name)
        if found.get("status") != "ready":
            raise fail(_line(found), 1)
        typer.echo(_line(found))

    @data_app.command("list")
    @cli_errors
    def list_(
        as_json: Annotated[bool, typer.Option("--json", help="the API's JSON")] = False,
    ) -> None:
        """Your datasets (an admin token: everyone's), newest first."""
        with make_client() as client:
            out = client.datasets()
        if as_json:
            typer.echo(json.dumps(out, indent=2))
            return
        rows = [
            [
                d["name"],
                d["status"],
                d.get("owner"),
                d.get("format"),
                fmt(d.get("bytes")),
                fmt(d.get("documents")),
                fmt(d.get("train_tokens")),
                fmt(d.get("val_tokens")),
                fmt(d.get("vocab_size")),
                when(d.get("created_at")),
            ]
            for d in out.get("items", [])
        ]
        header = ["NAME", "STATUS", "OWNER", "FORMAT", "BYTES", "DOCS", "TRAIN", "VAL", "VOCAB"]
        typer.echo(table(rows, [*header, "CREATED"]) if rows else "no datasets")

    @data_app.command("show")
    @cli_errors
    def show(
        name: Annotated[str, typer.Argument(metavar="NAME")],
        owner: Annotated[str | None, typer.Option("--owner", help="admin: whose")] = None,
        as_json: Annotated[bool, typer.Option("--json", help="the API's JSON")] = False,
    ) -> None:
        """One dataset: status, reason, counts, folder under the data root."""
        with make_client() as client:
            found = client.dataset(name, owner=owner)
        if as_json:
            typer.echo(json.dumps(found, indent=2))
            return
        typer.echo(_line(found))
        typer.echo(clean(f"folder {found.get('path')} (tokenizer {found.get('tokenizer')})"))

    @data_app.command("rm")
    @cli_errors
    def rm(
        name: Annotated[str, typer.Argument(metavar="NAME")],
        owner: Annotated[str | None, typer.Option("--owner", help="admin: whose")] = None,
    ) -> None:
        """Delete a dataset and its folder (refused while a queued or running job uses it)."""
        with make_client() as client:
            client.delete_dataset(name, owner=owner)
        typer.echo(clean(f"dataset {name} deleted"))
