"""The Hugging Face folder of a checkpoint, written by the trainer so the API only serves files.

    RUN_DIR/checkpoints/step-N/hf/    config.json, model.safetensors (and the dataset's
                                      tokenizer files when it has a Hugging Face tokenizer)

It sits inside the checkpoint it was made from, so retention (``checkpoint.keep``) prunes
both together. ``checkpoint.hf`` says when it is written (rank 0 only): ``final`` (the
default) for the last checkpoint of a run that reached ``steps`` (trainer.__main__, after
the process group is gone, so the training memory is freed), ``every`` for each checkpoint
as it is saved (trainer.train), ``none`` never. A preempted run writes none: its grace
period is for the checkpoint.

The model is read back from the checkpoint on disk (`trainer.export.load_model`: any
strategy, FSDP's shards included, LoRA merged) and written by `trainer.export.export`,
which loads the folder back with transformers and compares logits. It is written into
``step-N/.hf-tmp`` and renamed to ``hf``: a folder named ``hf`` is always complete.

Nothing here fails a run: without transformers or safetensors on the host, or on any
error, one line says so and the native checkpoint is still there (and downloadable). The
cost is the export's: on a 2-core CPU a tiny model takes ~4 s, most of it importing
transformers once per process (so ``every`` pays it at the first checkpoint only).

Standard library at import; torch and transformers load only when a folder is written,
so the API can read the names below.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "HF_DIR",
    "HF_TMP_DIR",
    "missing_packages",
    "publish",
    "publish_final",
    "start_warning",
]

HF_DIR = "hf"
HF_TMP_DIR = ".hf-tmp"
CONFIG_FILE = "config.json"  # what makes a folder an HF model (the API checks for it)


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


def _tokenizer(data_dir: Path | None) -> Path | None:
    """The dataset's Hugging Face tokenizer.json (None: byte-level, or not known)."""
    if data_dir is None:
        return None
    from trainer.tokenizer import BYTE, TokenizerError, dataset_tokenizer

    try:
        found = dataset_tokenizer(data_dir)
    except TokenizerError as exc:
        _say(f"hf: the folder gets no tokenizer: {exc}", error=True)
        return None
    return None if found == BYTE else Path(found)


def publish(checkpoint: Path, data_dir: Path | None = None) -> Path | None:
    """Write ``checkpoint/hf`` (a no-op if it is there); its path, or None when it could not
    be written (said in one line). ``data_dir``: the run's dataset, for its tokenizer."""
    final = checkpoint / HF_DIR
    if (final / CONFIG_FILE).is_file():
        return final
    missing = missing_packages()
    if missing:
        _say(
            f"hf: {checkpoint.name} gets no Hugging Face folder: {' and '.join(missing)} "
            "not installed here (pip install 'trainq[hf]'); the native checkpoint is there"
        )
        return None
    t0 = time.perf_counter()
    tmp = checkpoint / HF_TMP_DIR
    shutil.rmtree(tmp, ignore_errors=True)  # left by a process killed while writing
    try:
        from trainer.export import export, load_model

        model, _ = load_model(checkpoint.parent.parent, checkpoint)
        diff = export(model, tmp, "hf", tokenizer=_tokenizer(data_dir))
        shutil.rmtree(final, ignore_errors=True)  # an "hf" without config.json is not ours
        tmp.rename(final)
    except Exception as exc:  # a finished run stays finished; its native checkpoint serves
        shutil.rmtree(tmp, ignore_errors=True)
        _say(f"hf: could not write {final}: {_first_line(exc)}", error=True)
        return None
    took = time.perf_counter() - t0
    _say(f"hf: wrote {final} in {took:.1f}s (max |logit diff| {diff:.1e})")
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
