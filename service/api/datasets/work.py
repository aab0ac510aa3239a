"""The API process's dataset work: uploads in progress, and their preparation as children.

One ``DatasetWork`` per app (``app.state.datasets``). Preparation runs as a child process,
``python -m service.api.datasets.prepare`` (an argv list, no shell), awaited on the event
loop without blocking it. At most ``dataset_prepare_workers`` children live at once, warm
(started with an upload) or working: each holds a permit of ``FairSlots`` from its start to
its exit, and the permits go round between the owners with waiting work
(service.api.datasets.slots). A child
rather than a pool of long-lived processes: the corpus it holds in memory goes back to the
system when it exits, an out-of-memory kill takes only that dataset, it can be killed on
shutdown, and nothing is forked from this threaded process.

While this process uploads or prepares a dataset it beats its ``updated_at`` every
``dataset_heartbeat_s``; if it dies, the reconciler of any API process fails the dataset
after ``dataset_stale_s`` and removes its work files (``datasets.reap_stale``). On a clean
shutdown the children are killed and their datasets failed at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

import service
from service.api.core.models import utcnow
from service.api.core.settings import Settings
from service.api.datasets import quota
from service.api.datasets import service as datasets
from service.api.datasets.slots import FairSlots
from trainer.files import make_dirs

__all__ = ["DatasetWork"]

log = logging.getLogger(__name__)

# Only the last line of the child's stdout is read; a child that says more is cut short.
_MAX_OUTPUT = 1 << 20
_STOPPED = "the API process stopped while preparing it; upload it again"


class DatasetWork:
    def __init__(self, settings: Settings, sessions: sessionmaker[Session]) -> None:
        self.settings = settings
        self.sessions = sessions
        self.data_root = Path(settings.data_root)
        self.uploading: dict[str, int] = {}  # dataset id -> bytes received
        self.preparing: set[str] = set()
        self._slots: FairSlots | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._children: dict[str, asyncio.subprocess.Process] = {}
        # started with an upload, waiting for go: dataset id -> (child, its owner)
        self._warm: dict[str, tuple[asyncio.subprocess.Process, str]] = {}
        self._closing = False
        self._beat: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- the heartbeat ---------------------------------------------------------------------

    def _bind(self) -> asyncio.AbstractEventLoop:
        """The running loop; what belongs to a loop is made anew when it changes (a test may
        run the app on several loops in turn; a server runs one)."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._loop = loop
            self._slots = FairSlots(self.settings.dataset_prepare_workers)
            self._beat = None
            self._closing = False  # a closed app served again (tests)
        return loop

    def _start_beating(self) -> None:
        loop = self._bind()
        if self._beat is None or self._beat.done():
            self._beat = loop.create_task(self._beating())

    async def _beating(self) -> None:
        while self.uploading or self.preparing:
            await asyncio.sleep(self.settings.dataset_heartbeat_s)
            progress: dict[str, int | None] = {i: None for i in self.preparing}
            progress.update(self.uploading)
            if not progress:
                break
            try:
                await run_in_threadpool(datasets.heartbeat, self.sessions, progress)
            except Exception as exc:  # the database away: the next beat tries again
                log.warning("datasets: heartbeat failed: %s", exc)

    def track_upload(self, dataset_id: str) -> None:
        self.uploading[dataset_id] = 0
        self._start_beating()

    def untrack_upload(self, dataset_id: str) -> None:
        self.uploading.pop(dataset_id, None)

    # -- preparing -------------------------------------------------------------------------

    def slots(self) -> FairSlots:
        self._bind()
        assert self._slots is not None
        return self._slots

    async def warm(
        self,
        row: dict[str, Any],
        tokenizer: Path | None,
        vocab_size: int,
        val_fraction: float,
        options: list[str] | None = None,
    ) -> None:
        """Start the dataset's child now, if a permit is free (``FairSlots.try_take``: no
        one waits for it, and the owner holds less than half of them): its interpreter and
        imports (~0.5 s) overlap the upload. It gets ``go`` on stdin once the upload is
        complete; till then a byte-level text or jsonl child prepares the bytes already
        written (service.api.datasets.prepare), the others wait idle. The permit is taken
        before the child is started (no await between the check and the take), so a burst
        of uploads never starts more children than there are permits."""
        owner = row["owner"]
        slots = self.slots()
        if not slots.try_take(owner, share=max(1, slots.capacity // 2)):
            return
        argv = [*self._argv(row, tokenizer, vocab_size, val_fraction, options), "--wait-go"]
        try:
            proc = await self._spawn(argv, stdin=asyncio.subprocess.PIPE)
        except BaseException:
            slots.give(owner)
            raise
        self._warm[row["id"]] = (proc, owner)

    async def cool(self, dataset_id: str) -> None:
        """The upload failed: its warm child goes, and its slot with it, and what it had
        prepared of the upload so far (a byte-level child prepares while the upload comes)."""
        warm = self._warm.pop(dataset_id, None)
        if warm is None:
            return
        proc, owner = warm
        try:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            await proc.communicate(b"")  # closes its pipes too, and reaps it
        finally:
            self.slots().give(owner)
        _, out = datasets.work_paths(self.data_root, dataset_id)
        await run_in_threadpool(shutil.rmtree, out, ignore_errors=True)

    def start_prepare(
        self,
        row: dict[str, Any],
        tokenizer: Path | None,
        vocab_size: int,
        val_fraction: float,
        options: list[str] | None = None,
    ) -> None:
        """Prepare the uploaded dataset ``row`` (now ``preparing``) in the background."""
        self.preparing.add(row["id"])
        self._start_beating()
        argv = self._argv(row, tokenizer, vocab_size, val_fraction, options)
        warm = self._warm.pop(row["id"], None)
        proc = warm[0] if warm is not None else None
        task = self._bind().create_task(self._prepare(row["id"], row, argv, proc))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _argv(
        self,
        row: dict[str, Any],
        tokenizer: Path | None,
        vocab_size: int,
        val_fraction: float,
        options: list[str] | None = None,
    ) -> list[str]:
        """The child's argv; ``options``: chat and completion's (the router's, validated)."""
        upload, out = datasets.work_paths(self.data_root, row["id"])
        argv = [
            sys.executable,
            "-m",
            "service.api.datasets.prepare",
            "--format",
            row["format"],
            "--src",
            str(upload),
            "--out",
            str(out),
            "--dataset-path",
            row["path"],
            "--val-fraction",
            repr(val_fraction),
            "--vocab-size",
            str(vocab_size),
        ]
        if tokenizer is not None:
            argv += ["--tokenizer", str(tokenizer)]
        return argv + list(options or ())

    async def _spawn(self, argv: list[str], stdin: int) -> asyncio.subprocess.Process:
        env = dict(os.environ)
        # The child imports this package from where this process did (an unpacked checkout
        # as well as an installed one).
        here = str(Path(next(iter(service.__path__))).resolve().parent)
        env["PYTHONPATH"] = os.pathsep.join([here, *filter(None, [env.get("PYTHONPATH")])])
        return await asyncio.create_subprocess_exec(
            *argv,
            stdin=stdin,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            start_new_session=True,
        )

    async def _prepare(
        self,
        dataset_id: str,
        row: dict[str, Any],
        argv: list[str],
        warm: asyncio.subprocess.Process | None,
    ) -> None:
        slots, owner = self.slots(), row["owner"]
        try:
            if warm is None:
                await slots.take(owner)  # a warm child already holds its permit
            try:
                if self._closing:
                    result = {"ok": False}
                    if warm is not None:
                        await self._run(dataset_id, warm, b"stop\n")
                else:
                    proc = warm or await self._spawn(argv, stdin=asyncio.subprocess.DEVNULL)
                    result = await self._run(dataset_id, proc, b"go\n" if warm else None)
            finally:
                slots.give(owner)
            if self._closing:
                await run_in_threadpool(self._fail, dataset_id, _STOPPED)
            elif result.get("ok") is True:
                await run_in_threadpool(self._publish, row, result)
            else:
                reason = str(result.get("error") or "preparation failed")
                await run_in_threadpool(self._fail, dataset_id, reason)
        except asyncio.CancelledError:
            raise  # shutdown: close() fails what is left
        except Exception:
            log.exception("datasets: preparing %s failed", dataset_id)
            with contextlib.suppress(Exception):
                await run_in_threadpool(self._fail, dataset_id, "internal error while preparing")
        finally:
            self.preparing.discard(dataset_id)
            upload, _ = datasets.work_paths(self.data_root, dataset_id)
            upload.unlink(missing_ok=True)

    async def _run(
        self, dataset_id: str, proc: asyncio.subprocess.Process, go: bytes | None
    ) -> dict[str, Any]:
        self._children[dataset_id] = proc
        try:
            out, err = await proc.communicate(go)
        finally:
            self._children.pop(dataset_id, None)
        lines = out[-_MAX_OUTPUT:].decode("utf-8", "replace").strip().splitlines()
        try:
            result = json.loads(lines[-1]) if lines else None
        except ValueError:
            result = None
        if not isinstance(result, dict):
            tail = err.decode("utf-8", "replace").strip().splitlines()[-1:] or ["no output"]
            log.warning("datasets: preparing %s: exit %s: %s", dataset_id, proc.returncode, tail)
            code = proc.returncode
            why = f"killed by signal {-code}" if code is not None and code < 0 else f"exit {code}"
            return {"ok": False, "error": f"the preparation process failed ({why})"}
        return result

    def _publish(self, row: dict[str, Any], result: dict[str, Any]) -> None:
        """The prepared folder to its place, then ``ready``, counting the folder's real size
        against the owner's room (``quota.settle``); if it does not fit, or the row moved on
        meanwhile (the reconciler failed it), the folder goes again."""
        _, out = datasets.work_paths(self.data_root, row["id"])
        real = quota.folder_bytes(out)
        final = self.data_root / row["path"]
        make_dirs(final.parent)
        shutil.rmtree(final, ignore_errors=True)  # a leftover of a crash between the two
        os.rename(out, final)
        values = {
            "status": "ready",
            "train_tokens": int(result["train_tokens"]),
            "val_tokens": int(result["val_tokens"]),
            "vocab_size": int(result["vocab_size"]),
            "report": result.get("sft"),
            "ready_at": utcnow(),
        }
        limit = self.settings.dataset_max_owner_bytes
        refused = quota.settle(self.sessions, row["id"], row["owner"], real, limit, values)
        if refused is not None:
            shutil.rmtree(final, ignore_errors=True)

    def _fail(self, dataset_id: str, reason: str) -> None:
        datasets.set_status(
            self.sessions,
            dataset_id,
            "preparing",
            status="failed",
            reason=reason[:2000],
            disk_bytes=0,  # its files go: it holds none of the owner's room
        )
        datasets.remove_work(self.data_root, dataset_id)

    # -- shutdown --------------------------------------------------------------------------

    async def close(self) -> None:
        """Kill the children and fail what they were preparing (their tasks see to it)."""
        self._closing = True
        for proc in list(self._children.values()):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
        for dataset_id in list(self._warm):
            await self.cool(dataset_id)
        loop = asyncio.get_running_loop()
        tasks = [t for t in self._tasks if t.get_loop() is loop]
        if tasks:
            await asyncio.wait(tasks, timeout=30)
        for task in tasks:
            task.cancel()
        if self._beat is not None and self._beat.get_loop() is loop:
            self._beat.cancel()
            await asyncio.gather(self._beat, return_exceptions=True)
