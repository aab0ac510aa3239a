"""Export a run's trained model for inference: ONNX, a torch.export program (.pt2), a
Hugging Face folder (hf), or a LoRA run's adapter as PEFT writes it (peft).

    python -m trainer.export --run-dir RUN --out model.onnx [--format onnx|pt2|hf|peft]
                             [--checkpoint RUN/checkpoints/step-N] [--config run.yaml]
                             [--base]

The weights come from the run's newest complete checkpoint (or ``--checkpoint``), whatever
strategy wrote it: one process and DDP save a full state dict, FSDP a sharded
``torch.distributed.checkpoint``, which is read here into one process without a process
group. The model's shape comes from the checkpoint's meta.json (``--config`` or the run's
config.json for checkpoints written before it carried one). The exported graph maps token
ids ``tokens`` [batch, seq] (int64, seq <= model.seq_len) to ``logits`` [batch, seq, vocab],
with batch and sequence length dynamic. Before returning, the file is loaded back (ONNX
Runtime for .onnx, when installed) and its logits compared with the checkpointed model's.

``--format hf`` writes ``--out`` as a folder (config.json, model.safetensors) that
``transformers.AutoModelForCausalLM.from_pretrained`` loads: ``GPT2LMHeadModel`` for the gpt
family, ``LlamaForCausalLM`` for llama (trainer.hf), and for family ``hf`` the model's own
``save_pretrained``; a LoRA run's adapters are merged first (``--base``: left out, the base
weights alone, what a peft export loads on). It is loaded back with transformers and its
logits compared the same way. It needs the ``hf`` extra (transformers, safetensors).
The run's tokenizer goes with it (the dataset's: ``data.path`` of the run's config.json, or
``--config``, under ``--data-root``): the dataset's ``tokenizer.json`` (trainer.prepare
copies it there) with its bos/eos/pad declared in tokenizer_config.json and
generation_config.json, or for a byte-level dataset a byte-level tokenizer.json (256 tokens,
id == byte); ``transformers.AutoTokenizer`` loads it back and must encode alike.

``--format peft`` writes a LoRA run's adapters, not merged, as PEFT does
(adapter_config.json, adapter_model.safetensors under PEFT's names, and the tokenizer), for
``PeftModel.from_pretrained(base, OUT)`` on the base (family hf: ``model.path``'s folder; gpt
and llama: ``--format hf --base``); with peft installed it is loaded back so and compared.

The file is 0640 and a folder made for it 0750, whatever the umask (trainer.files).

TorchScript is not offered: ``torch.jit`` is deprecated in the torch this targets, and
torch.export is its successor. ONNX needs the ``export`` extra (onnx, onnxscript).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, Literal, NoReturn

import torch

from trainer.checkpoint import latest_checkpoint
from trainer.config import (
    AnyModelConfig,
    ConfigError,
    LoraConfig,
    load_config,
    resolve_data_path,
)
from trainer.files import FILE_MODE, UMASK, make_dirs
from trainer.models import vocab_size
from trainer.restore import ATOL, ExportError, checkpoint_config, load_model
from trainer.tokenizer import BYTE, TokenizerError, dataset_tokenizer

__all__ = [
    "ATOL",
    "ExportError",
    "checkpoint_config",
    "export",
    "export_checkpoint",
    "load_model",
]

Tokenizer = Path | Literal["byte"] | None

Format = Literal["onnx", "pt2", "hf", "peft"]
FOLDERS = ("hf", "peft")  # the formats written as a folder
FORMATS: dict[str, Format] = {".onnx": "onnx", ".pt2": "pt2"}


def _sample(cfg: AnyModelConfig, batch: int, seq: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size(cfg), (batch, min(seq, cfg.seq_len)), generator=gen)


def run_tokenizer(
    run_dir: Path, config: Path | None = None, data_root: str | os.PathLike[str] | None = None
) -> Tokenizer:
    """The run's tokenizer: the Hugging Face tokenizer.json of its dataset, ``"byte"`` for a
    byte-level dataset, or None (no config.json to name the dataset, or the dataset is not
    there): ``data.path`` of ``config`` (default: the run's config.json) resolved under
    ``data_root`` (trainer.tokenizer.dataset_tokenizer)."""
    path = config or run_dir / "config.json"
    if not path.is_file():
        return None
    cfg = load_config(path)
    data_dir = resolve_data_path(
        cfg.data.path, data_root, allow_absolute=True, dataset=cfg.data.dataset
    )
    return dataset_dir_tokenizer(data_dir)


def dataset_dir_tokenizer(data_dir: Path | None) -> Tokenizer:
    """The tokenizer of a dataset folder (already resolved): its tokenizer.json, ``"byte"``,
    or None when the folder is not there (said on stderr)."""
    if data_dir is None:
        return None
    if not data_dir.is_dir():
        print(f"trainer.export: note: the run's dataset {data_dir} is not there (--data-root?): "
              "no tokenizer is exported", file=sys.stderr)  # fmt: skip
        return None
    try:
        found = dataset_tokenizer(data_dir)
    except TokenizerError as exc:
        raise ExportError(str(exc)) from None
    return BYTE if found == BYTE else Path(found)


def export(
    model: Any, out: Path, fmt: Format, *, atol: float = ATOL, tokenizer: Tokenizer = None
) -> float:
    """Write ``out``; the largest absolute logit difference of the file against ``model``
    on a batch of another shape than the one traced (so the dynamic dims are exercised).
    ``hf`` raises ExportError itself past ``atol``, and writes ``tokenizer`` beside
    (``peft``: `export_checkpoint`, which knows the adapters' config)."""
    if fmt == "hf":
        from trainer.hf import write_hf

        return write_hf(model, out, atol=atol, tokenizer=tokenizer)
    if fmt == "peft":
        raise ExportError("format peft is written from a checkpoint (export_checkpoint)")
    from torch.export import Dim

    cfg = model.cfg
    example = _sample(cfg, 2, cfg.seq_len)
    dims = {0: Dim("batch", min=1, max=4096), 1: Dim("seq", min=2, max=cfg.seq_len)}
    check = _sample(cfg, 3, max(2, cfg.seq_len // 2))
    make_dirs(out.parent)
    with torch.no_grad():
        expected = model(check)
        if fmt == "pt2":
            program = torch.export.export(model, (example,), dynamic_shapes=(dims,))
            torch.export.save(program, out)
            os.chmod(out, FILE_MODE)
            got = torch.export.load(out).module()(check)
        else:
            if (missing := missing_extra("onnx")) is not None:
                raise ExportError(missing)
            torch.onnx.export(
                model,
                (example,),
                str(out),
                dynamo=True,
                dynamic_shapes=(dims,),
                input_names=["tokens"],
                output_names=["logits"],
                verbose=False,
            )
            os.chmod(out, FILE_MODE)
            if importlib.util.find_spec("onnxruntime") is None:
                return float("nan")  # written, not checked
            import onnxruntime

            session = onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"])
            got = torch.from_numpy(session.run(None, {"tokens": check.numpy()})[0])
    return float((got - expected).abs().max())


# What each format needs beyond torch, and the one install that brings it.
EXTRAS: dict[str, tuple[tuple[str, ...], str]] = {
    "hf": (("transformers", "safetensors"), "pip install 'trainq[hf]'"),
    "peft": (("transformers", "safetensors"), "pip install 'trainq[hf]'"),
    "onnx": (("onnx", "onnxscript"), "pip install 'trainq[export]'"),
}


def missing_extra(fmt: str, find: Any = importlib.util.find_spec) -> str | None:
    """The one-line error for a format whose optional packages are not installed, or None.
    ``find`` is the import probe (``importlib.util.find_spec``), a parameter for tests."""
    modules, install = EXTRAS.get(fmt, ((), ""))
    absent = [m for m in modules if find(m) is None]
    if not absent:
        return None
    return f"--format {fmt} needs {' and '.join(modules)} ({', '.join(absent)} missing): {install}"


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line with the fix, not the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def main(argv: list[str] | None = None) -> int:
    p = _Parser(prog="python -m trainer.export", description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", type=Path, help="the run's folder (default: --checkpoint's run)")
    p.add_argument(
        "--out",
        required=True,
        type=Path,
        help="the file to write (.onnx, .pt2) or folder (hf, peft)",
    )
    p.add_argument(
        "--format", choices=("onnx", "pt2", "hf", "peft"), help="default: from --out's suffix"
    )
    p.add_argument(
        "--base",
        action="store_true",
        help="hf of a LoRA run: the base weights without the adapters (what peft loads on)",
    )
    p.add_argument(
        "--checkpoint",
        type=Path,
        help="a step-N folder, or what `trainq download ID -o DIR` wrote (default: the run's "
        "newest complete one)",
    )
    p.add_argument("--config", type=Path, help="the run's config (for old checkpoints)")
    p.add_argument(
        "--data-root",
        default=os.environ.get("TRAINQ_DATA_ROOT"),
        help="what the run's data.path is under, for the tokenizer of hf and peft "
        "(default: $TRAINQ_DATA_ROOT, else the current folder)",
    )
    p.add_argument("--atol", type=float, default=ATOL, help="largest logit difference allowed")
    args = p.parse_args(argv)
    fmt = args.format or FORMATS.get(args.out.suffix.lower())
    if fmt is None:
        p.error(f"--out {args.out}: name it .onnx or .pt2, or pass --format (hf, peft: a folder)")
    if args.base and fmt != "hf":
        p.error("--base is for --format hf (the base weights of a LoRA run)")
    if args.run_dir is None and args.checkpoint is None:
        p.error("give --run-dir RUN (a run's folder) or --checkpoint DIR")
    try:
        diff, step, source = _run(args, fmt)
    except (ExportError, ConfigError) as exc:
        return _fail(str(exc))
    except OSError as exc:  # --out not writable, a file vanishing under us
        return _fail(f"cannot write {args.out}: {exc.strerror or exc}")
    except Exception as exc:  # the last resort: a line, not a traceback
        first = (str(exc).strip().splitlines() or [""])[0]
        return _fail(f"{fmt} export of {source_of(args)} failed: {type(exc).__name__}: {first}")
    if diff > args.atol:  # NaN (unchecked) compares False
        return _fail(f"{args.out} differs from the model by {diff:.2e} (> --atol {args.atol})")
    checker = "peft" if fmt == "peft" else "onnxruntime"
    checked = f"not checked (no {checker})" if diff != diff else f"max |logit diff| {diff:.1e}"
    print(f"exported step {step} of {source} to {args.out} ({fmt}); {checked}")
    return 0


def source_of(args: argparse.Namespace) -> Path:
    return Path(args.checkpoint if args.run_dir is None else args.run_dir)


def _run(args: argparse.Namespace, fmt: Format) -> tuple[float, int, Path]:
    """Check, load and export; (the logit difference, the step, what it came from)."""
    if (missing := missing_extra(fmt)) is not None:
        raise ExportError(missing)
    checkpoint: Path | None = args.checkpoint
    if checkpoint is not None and not (checkpoint / "meta.json").is_file():
        raise ExportError(
            f"--checkpoint {checkpoint} is not a checkpoint (no meta.json): give a run's "
            "checkpoints/step-N folder, or what `trainq download ID -o DIR` wrote"
        )
    run_dir: Path | None = args.run_dir
    if run_dir is None:  # RUN/checkpoints/step-N, or a folder of its own (a download)
        assert checkpoint is not None
        inside = checkpoint.absolute().parent
        run_dir = inside.parent if inside.name == "checkpoints" else checkpoint
    elif not run_dir.is_dir():
        raise ExportError(
            f"--run-dir {run_dir} is not a folder: give a run's folder (TRAINQ_RUNS_ROOT/JOB_ID"
            " where it trained), or `trainq download ID -o DIR` and pass --checkpoint DIR"
        )
    elif checkpoint is None and latest_checkpoint(run_dir) is None:
        raise ExportError(
            f"no complete checkpoint in {run_dir / 'checkpoints'}: a run writes one every "
            "train.checkpoint.every steps and when it ends; wait for one, or pass --checkpoint DIR"
        )
    tokenizer = None
    if fmt in FOLDERS:
        tokenizer = run_tokenizer(run_dir, args.config, args.data_root)
    diff, step = export_checkpoint(
        run_dir,
        checkpoint,
        args.out,
        fmt,
        config=args.config,
        tokenizer=tokenizer,
        atol=args.atol,
        base=args.base,
    )
    return diff, step, source_of(args)


def _lora(path: Path, config: Path | None) -> LoraConfig | None:
    meta, _ = checkpoint_config(path, config)
    return LoraConfig.model_validate(meta["lora"]) if meta.get("lora") else None


def base_name(run_dir: Path, model_cfg: AnyModelConfig, config: Path | None = None) -> str | None:
    """What a LoRA run's adapters were trained on, for adapter_config.json, as the run's
    config spells it (under the data root; no host path): family hf's ``model.path``, else
    ``init.path`` or ``init.job``; None for a base the run drew itself (its weights:
    ``--format hf --base``)."""
    source = config or run_dir / "config.json"
    run_cfg = load_config(source) if source.is_file() else None
    if model_cfg.family == "hf":
        spelled = getattr(run_cfg.model, "path", None) if run_cfg is not None else None
        if isinstance(spelled, str):
            return spelled
        return Path(str(getattr(model_cfg, "path", ""))).name or None
    init = run_cfg.init if run_cfg is not None else None
    if init is None:
        return None
    return init.path if init.path is not None else f"job {init.job}"


def export_checkpoint(
    run_dir: Path,
    checkpoint: Path | None,
    out: Path,
    fmt: Format,
    *,
    config: Path | None = None,
    tokenizer: Tokenizer = None,
    atol: float = ATOL,
    base: bool = False,
) -> tuple[float, int]:
    """Load a checkpoint (``None``: the run's newest) and write it as ``fmt`` (`export`;
    ``peft``: trainer.hf.write_peft with the checkpoint's LoRA config); (the logit
    difference, the step). ``base``: hf of the weights without a LoRA run's adapters."""
    path = checkpoint or latest_checkpoint(run_dir)
    if path is None:
        raise ExportError(f"no complete checkpoint in {run_dir / 'checkpoints'}")
    lora = _lora(path, config)
    if fmt == "peft" or base:
        if lora is None:
            what = "format peft" if fmt == "peft" else "--base"
            raise ExportError(f"{what} is for LoRA runs: checkpoint {path} has no adapters")
        model, step = load_model(run_dir, path, config, merge=False)
        if base:
            from trainer.lora import drop_lora

            drop_lora(model)
            return export(model, out, "hf", atol=atol, tokenizer=tokenizer), step
        from trainer.hf import write_peft

        name = base_name(run_dir, model.cfg, config)
        diff = write_peft(model, out, lora, base_name=name, atol=atol, tokenizer=tokenizer)
        return diff, step
    model, step = load_model(run_dir, path, config)
    return export(model, out, fmt, atol=atol, tokenizer=tokenizer), step


def _fail(message: str) -> int:
    print(f"trainer.export: error: {message}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    os.umask(UMASK)  # what torch writes beside the file (ONNX external data) too
    sys.exit(main())
