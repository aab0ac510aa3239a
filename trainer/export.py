"""Export a run's trained model for inference: ONNX, a torch.export program (.pt2), or a
Hugging Face folder (hf).

    python -m trainer.export --run-dir RUN --out model.onnx [--format onnx|pt2|hf]
                             [--checkpoint RUN/checkpoints/step-N] [--config run.yaml]

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
family, ``LlamaForCausalLM`` for llama (trainer.hf); it is loaded back with transformers and
its logits compared the same way. It needs the ``hf`` extra (transformers, safetensors).
When the run's dataset (``data.path`` of the run's config.json, or ``--config``, under
``--data-root``) holds a ``tokenizer.json`` (trainer.prepare copies it there), the folder
gets it too, with a ``tokenizer_config.json`` that ``transformers.AutoTokenizer`` loads.

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
from typing import Any, Literal

import torch

from trainer.config import (
    AnyModelConfig,
    ConfigError,
    load_config,
    resolve_data_path,
)
from trainer.files import FILE_MODE, UMASK, make_dirs
from trainer.models import vocab_size
from trainer.restore import ATOL, ExportError, checkpoint_config, load_model
from trainer.tokenizer import BYTE, TokenizerError, dataset_tokenizer

__all__ = ["ATOL", "ExportError", "checkpoint_config", "export", "load_model"]

Format = Literal["onnx", "pt2", "hf"]
FORMATS: dict[str, Format] = {".onnx": "onnx", ".pt2": "pt2"}


def _sample(cfg: AnyModelConfig, batch: int, seq: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size(cfg), (batch, min(seq, cfg.seq_len)), generator=gen)


def run_tokenizer(
    run_dir: Path, config: Path | None = None, data_root: str | os.PathLike[str] | None = None
) -> Path | None:
    """The Hugging Face tokenizer.json of the run's dataset, or None (byte-level, or no
    config.json to name the dataset): ``data.path`` of ``config`` (default: the run's
    config.json) resolved under ``data_root`` (trainer.tokenizer.dataset_tokenizer)."""
    path = config or run_dir / "config.json"
    if not path.is_file():
        return None
    cfg = load_config(path)
    data_dir = resolve_data_path(
        cfg.data.path, data_root, allow_absolute=True, dataset=cfg.data.dataset
    )
    if not data_dir.is_dir():
        print(f"trainer.export: note: the run's dataset {data_dir} is not there (--data-root?): "
              "no tokenizer is exported", file=sys.stderr)  # fmt: skip
        return None
    try:
        found = dataset_tokenizer(data_dir)
    except TokenizerError as exc:
        raise ExportError(str(exc)) from None
    return None if found == BYTE else Path(found)


def export(
    model: Any, out: Path, fmt: Format, *, atol: float = ATOL, tokenizer: Path | None = None
) -> float:
    """Write ``out``; the largest absolute logit difference of the file against ``model``
    on a batch of another shape than the one traced (so the dynamic dims are exercised).
    ``hf`` raises ExportError itself past ``atol``, and writes ``tokenizer`` beside."""
    if fmt == "hf":
        from trainer.hf import write_hf

        return write_hf(model, out, atol=atol, tokenizer=tokenizer)
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
            if importlib.util.find_spec("onnxscript") is None:
                raise ExportError("ONNX export needs onnx and onnxscript: pip install '.[export]'")
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m trainer.export", description=__doc__.splitlines()[0]
    )
    p.add_argument("--run-dir", required=True, type=Path)
    p.add_argument(
        "--out", required=True, type=Path, help="the file to write (.onnx, .pt2) or folder (hf)"
    )
    p.add_argument("--format", choices=("onnx", "pt2", "hf"), help="default: from --out's suffix")
    p.add_argument("--checkpoint", type=Path, help="default: the newest complete one")
    p.add_argument("--config", type=Path, help="the run's config (for old checkpoints)")
    p.add_argument(
        "--data-root",
        default=os.environ.get("TRAINQ_DATA_ROOT"),
        help="what the run's data.path is under, for hf's tokenizer "
        "(default: $TRAINQ_DATA_ROOT, else the current folder)",
    )
    p.add_argument("--atol", type=float, default=ATOL, help="largest logit difference allowed")
    args = p.parse_args(argv)
    fmt = args.format or FORMATS.get(args.out.suffix.lower())
    if fmt is None:
        p.error(f"--out {args.out}: name it .onnx or .pt2, or pass --format (hf: a folder)")
    try:
        model, step = load_model(args.run_dir, args.checkpoint, args.config)
        tokenizer = (
            run_tokenizer(args.run_dir, args.config, args.data_root) if fmt == "hf" else None
        )
        diff = export(model, args.out, fmt, atol=args.atol, tokenizer=tokenizer)
    except (ExportError, ConfigError) as exc:
        print(f"trainer.export: error: {exc}", file=sys.stderr)
        return 1
    if diff > args.atol:  # NaN (unchecked) compares False
        print(f"trainer.export: error: {args.out} differs from the model by {diff:.2e} "
              f"(> --atol {args.atol})", file=sys.stderr)  # fmt: skip
        return 1
    checked = "not checked (no onnxruntime)" if diff != diff else f"max |logit diff| {diff:.1e}"
    print(f"exported step {step} of {args.run_dir} to {args.out} ({fmt}); {checked}")
    return 0


if __name__ == "__main__":
    os.umask(UMASK)  # what torch writes beside the file (ONNX external data) too
    sys.exit(main())
