"""``python -m trainer`` (one process) or ``torchrun ... -m trainer`` (one per rank).

    torchrun --standalone --nproc-per-node 2 -m trainer --config run.yaml --run-dir DIR \\
        [--data-root ROOT]

The config is validated before torch is imported, let alone a process group started. A
known failure prints one line (no traceback), writes RUN_DIR/exit.json and exits with its
`trainer.events.ExitCode`. Any other exception is recorded in RUN_DIR/exit.json as one line
(``IndexError: ...``, the first failing rank's) before its traceback is printed.

Everything the run writes is group-readable at most (trainer.files): the process runs with
that umask, whatever it inherited.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

from trainer.config import (
    ConfigError,
    load_config,
    resolve_data_path,
    resolve_init_path,
    resolve_model_path,
)
from trainer.env import (
    EXIT_FILE,
    TrainerEnv,
    exit_with_launcher,
    read_env,
    write_crash,
    write_exit_file,
)
from trainer.events import ExitCode
from trainer.files import UMASK, make_dirs


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="TrainConfig as YAML or JSON")
    p.add_argument(
        "--run-dir",
        required=True,
        type=Path,
        help="checkpoints/, metrics.jsonl and exit.json go here; resumes if it holds a checkpoint",
    )
    p.add_argument(
        "--data-root",
        default=None,
        help="folder that a relative data.path is resolved against (default: cwd)",
    )
    return p


def _known_failure(
    env: TrainerEnv, run_dir: Path, code: ExitCode, message: str, data_root: str | None = None
) -> int:
    # Every rank hits a config or data error alike; rank 0 speaks for all of them.
    message = _relative(message, run_dir, data_root)
    if env.is_main:
        print(f"trainer: error: {message}", file=sys.stderr, flush=True)
        write_exit_file(run_dir, "spec_error", message, rank=env.rank, step=None, exit_code=code)
    else:
        _await_verdict(run_dir, "spec_error")
    return code


def _relative(message: str, run_dir: Path, data_root: str | None) -> str:
    """The message with the server's absolute folders spelled as the spec names them: a
    path under the data root relative to it, the run folder as ``the run folder`` (the
    messages are written that way; this catches what a library's message adds)."""
    pairs = [(str(run_dir.resolve()), "the run folder"), (str(run_dir), "the run folder")]
    if data_root is not None:
        pairs += [(str(Path(data_root).resolve()), ""), (str(data_root), "")]
    for folder, said in sorted(pairs, key=lambda p: -len(p[0])):
        if len(folder) > 1:
            message = message.replace(folder + os.sep, f"{said}/" if said else "")
            message = message.replace(folder, said or ".")
    return message


def _await_verdict(run_dir: Path, reason: str, timeout_s: float = 10.0) -> None:
    """Wait (bounded) until rank 0 has written its ``reason`` to RUN_DIR/exit.json.

    torchrun stops every rank as soon as one exits: a rank that returned first could have
    rank 0 killed before it printed its line and wrote the file. A file left by an earlier
    attempt carries another reason, or rank 0 has already removed it.
    """
    path = run_dir / EXIT_FILE
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if json.loads(path.read_text(encoding="utf-8")).get("reason") == reason:
                return
        except (OSError, ValueError):  # not there yet, or still being written
            pass
        time.sleep(0.01)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    run_dir: Path = args.run_dir
    try:
        env = read_env()
    except ValueError as exc:
        print(f"trainer: error: {exc}", file=sys.stderr, flush=True)
        return ExitCode.SPEC_ERROR
    if env.distributed:
        exit_with_launcher()
    if env.is_main:
        make_dirs(run_dir)
        # A previous attempt's verdict must not be read as this one's.
        (run_dir / EXIT_FILE).unlink(missing_ok=True)
    try:
        return _main(args, run_dir, env)
    except Exception as exc:
        # train() records a crash itself before the process group goes; this catches the
        # rest (an import, a config file's loader). The first record wins either way.
        write_crash(run_dir, exc, rank=env.rank, step=None)
        raise


def _main(args: argparse.Namespace, run_dir: Path, env: TrainerEnv) -> int:
    try:
        cfg = load_config(args.config)
        data_dir = resolve_data_path(
            cfg.data.path, args.data_root, allow_absolute=True, dataset=cfg.data.dataset
        )
        model = resolve_model_path(cfg.model, args.data_root)
        cfg = resolve_init_path(cfg.model_copy(update={"model": model}), args.data_root)
    except ConfigError as exc:
        return _known_failure(env, run_dir, ExitCode.SPEC_ERROR, str(exc), args.data_root)

    from trainer.checkpoint import CheckpointError  # torch from here on
    from trainer.data import DataError
    from trainer.train import train

    try:
        code = train(cfg, run_dir, data_dir, env)
    except (ConfigError, CheckpointError) as exc:
        return _known_failure(env, run_dir, ExitCode.SPEC_ERROR, str(exc), args.data_root)
    except DataError as exc:
        return _known_failure(env, run_dir, ExitCode.DATA_ERROR, str(exc), args.data_root)
    if code == ExitCode.OK and env.is_main:
        # The finished run's Hugging Face folder (checkpoint.hf), from its last checkpoint on
        # disk, after the process group and the training state are gone; never fails the run.
        from trainer.publish import publish_final

        publish_final(cfg, run_dir, data_dir)
    return code


if __name__ == "__main__":
    os.umask(UMASK)  # here, not in main(): a test calling main() keeps its own umask
    code = main()
    # The interpreter's last full collection walks every object that torch and its imports
    # made: ~1 s per rank on a small CPU, after the run is done and before the launcher sees
    # it end. Frozen objects are skipped by it; finalizers and atexit handlers still run.
    gc.freeze()
    from trainer.tracking import abandoned

    if abandoned():  # a tracker's library would hold the exit (trainer.tracking): not so
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
