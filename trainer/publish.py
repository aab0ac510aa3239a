"""The Hugging Face folders of a checkpoint, written by the trainer so the API only serves files.

    RUN_DIR/checkpoints/step-N/hf/    config.json, model.safetensors (family hf: what its
                                      save_pretrained writes), the run's tokenizer
                           step-N/peft/  a LoRA run's adapter as PEFT writes it
                                      (adapter_config.json, adapter_model.safetensors)
                           step-N/hf.failed.json, peft.failed.json
                                      {"reason": ...}: that export was asked for and failed

It sits inside the checkpoint it was made from, so retention (``checkpoint.keep``) prunes
both together. ``checkpoint.hf`` says when it is written (rank 0 only): ``final`` (the
default) for the last checkpoint of a run that reached ``steps`` (trainer.__main__, after
the process group is gone, so the training memory is freed), ``every`` for each checkpoint
as it is saved (trainer.train), ``none`` never. A preempted run writes none: its grace
period is for the checkpoint.

The model is read back from the checkpoint on disk (`trainer.export.load_model`: any
strategy, FSDP's shards included, LoRA merged) and written by `trainer.export.export`,
which loads the folder back with transformers and compares logits. It is written into
``step-N/.hf-tmp`` and renamed to ``hf``: a folder named ``hf`` is always complete. A LoRA
run gets ``peft`` beside it the same way (trainer.hf.write_peft, through ``.peft-tmp``).

Nothing here fails a run: without transformers or safetensors on the host, or on any
error, one line says so, ``FORMAT.failed.json`` in the checkpoint says why (the checkpoints
API lists it, and a download of that format answers with it), and the native checkpoint is
still there (and downloadable). A later success removes the marker. The
cost is the export's: on a 2-core CPU a tiny model takes ~4 s, most of it importing
transformers once per process (so ``every`` pays it at the first checkpoint only).

Standard library at import; torch and transformers load only when a folder is written,
so the API can read the names below.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "EXPORT_DIRS",
    "FAILED_SUFFIX",
    "HF_DIR",
    "HF_TMP_DIR",
    "PEFT_DIR",
    "PEFT_TMP_DIR",
    "failed_name",
    "missing_packages",
    "publish",
    "publish_final",
    "start_warning",
]

HF_DIR = "hf"
HF_TMP_DIR = ".hf-tmp"
PEFT_DIR = "peft"
PEFT_TMP_DIR = ".peft-tmp"
CONFIG_FILE = "config.json"  # what makes a folder an HF model (the API checks for it)
ADAPTER_CONFIG = "adapter_config.json"  # what makes a folder a PEFT adapter
# format -> (its folder, the folder it is written in first, the file that makes it whole)
EXPORT_DIRS: dict[str, tuple[str, str, str]] = {
    "hf": (HF_DIR, HF_TMP_DIR, CONFIG_FILE),
    "peft": (PEFT_DIR, PEFT_TMP_DIR, ADAPTER_CONFIG),
}
FAILED_SUFFIX = ".failed.json"
_REASON_CHARS = 2000


def failed_name(fmt: str) -> str:
    """The file in step-N that says the format's export failed: ``hf.failed.json``."""
    return f"{fmt}{FAILED_SUFFIX}"


def missing_packages(find: Callable[[str], object] = importlib.util.find_spec) -> list[str]:
    """The packages of the ``hf`` extra that this host lacks; ``find`` is the import probe
    (a parameter for tests, which cannot uninstall a package)."""
    return [m for m in ("safetensors", "transformers") if find(m) is None]


def start_warning(find: Callable[[str], object] = importlib.util.find_spec) -> str | None:
    """What a worker says once at start on a host without the ``hf`` extra, or None: its
    finished jobs get no Hugging Face folder, so their ``--format hf`` download is refused."""
    missing = missing_packages(find)
    if not missing:
        return None
    return (
        f"{' and '.join(missing)} not installed on this worker: its jobs' checkpoints get no "
        "Hugging Face folder (trainq download --format hf answers 409 for them); "
        "pip install 'trainq[hf]' here"
    )


def _say(line: str, *, error: bool = False) -> None:
    print(line, file=sys.stderr if error else sys.stdout, flush=True)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _mark_failed(checkpoint: Path, fmt: str, reason: str) -> None:
    """step-N/FORMAT.failed.json: {"reason": ..., "time": ...} (0640; never fails)."""
    from trainer.files import FILE_MODE, set_mode

    path = checkpoint / failed_name(fmt)
    body = json.dumps({"reason": reason[:_REASON_CHARS], "time": time.time()}) + "\n"
    try:
        path.unlink(missing_ok=True)  # not through a link left there
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE)
        set_mode(fd)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(body)
    except OSError as exc:
        _say(f"{fmt}: could not record the failure in {path}: {exc}", error=True)


def _is_lora(checkpoint: Path) -> bool:
    try:
        meta = json.loads((checkpoint / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and bool(meta.get("lora"))


def publish(checkpoint: Path, data_dir: Path | None = None) -> Path | None:
    """Write ``checkpoint/hf``, and ``checkpoint/peft`` for a LoRA run (each a no-op if it
    is there); the hf folder's path, or None when it could not be written (said in one line
    and in ``hf.failed.json``). ``data_dir``: the run's dataset, for its tokenizer."""
    final = publish_format(checkpoint, "hf", data_dir)
    if _is_lora(checkpoint):
        publish_format(checkpoint, "peft", data_dir)
    return final


def publish_format(checkpoint: Path, fmt: str, data_dir: Path | None = None) -> Path | None:
    """Write ``checkpoint/<fmt>`` (hf or peft) through its temporary folder; its path, or
    None when it could not be written (one line, and ``<fmt>.failed.json`` says why)."""
    name, tmp_name, marker = EXPORT_DIRS[fmt]
    final = checkpoint / name
    if (final / marker).is_file():
        return final
    missing = missing_packages()
    if missing:
        why = f"{' and '.join(missing)} not installed on the worker (pip install 'trainq[hf]')"
        _say(
            f"{fmt}: {checkpoint.name} gets no {name} folder: {why}; the native checkpoint is there"
        )
        _mark_failed(checkpoint, fmt, why)
        return None
    t0 = time.perf_counter()
    tmp = checkpoint / tmp_name
    shutil.rmtree(tmp, ignore_errors=True)  # left by a process killed while writing
    try:
        from trainer.export import dataset_dir_tokenizer, export_checkpoint

        tokenizer = dataset_dir_tokenizer(data_dir)
        run_dir = checkpoint.parent.parent
        diff, _ = export_checkpoint(run_dir, checkpoint, tmp, fmt, tokenizer=tokenizer)  # type: ignore[arg-type]
        shutil.rmtree(final, ignore_errors=True)  # a folder without its marker is not ours
        tmp.rename(final)
    except Exception as exc:  # a finished run stays finished; its native checkpoint serves
        shutil.rmtree(tmp, ignore_errors=True)
        _say(f"{fmt}: could not write {final}: {_first_line(exc)}", error=True)
        _mark_failed(checkpoint, fmt, _first_line(exc))
        return None
    (checkpoint / failed_name(fmt)).unlink(missing_ok=True)
    took = time.perf_counter() - t0
    checked = "not checked (no peft)" if diff != diff else f"max |logit diff| {diff:.1e}"
    _say(f"{fmt}: wrote {final} in {took:.1f}s ({checked})")
    return final


def publish_final(cfg: Any, run_dir: Path, data_dir: Path | None = None) -> Path | None:
    """After a run that returned success: the last checkpoint's folder, if the run reached
    ``cfg.steps`` (not a preemption) and ``cfg.checkpoint.hf`` asks for one."""
    if cfg.checkpoint.hf == "none":
        return None
    from trainer.checkpoint import checkpoint_dirs

    found = checkpoint_dirs(run_dir)
    if not found or found[-1][0] != cfg.steps:
        return None
    return publish(found[-1][1], data_dir)
