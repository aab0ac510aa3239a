"""Hugging Face weights in and out for the native families (the maps: trainer.hf_io).

Out: `write_hf` writes a folder (config.json, model.safetensors, and the dataset's tokenizer
when it had one) that ``transformers.AutoModelForCausalLM.from_pretrained`` loads, then
loads it back with transformers and compares logits with the model's (at most 1e-4 apart in
fp32 by default; they agree to the last bit on small models). In: `load_init` starts a run
from a Hugging Face folder under the data root (``init.path``) or from another job's
checkpoint (``init.job``); `check_init` is its cheap half (shapes from the safetensors
headers or the checkpoint's meta, on the meta device), which the trainer runs before any
process group so a misfit is a spec_error naming the tensor and both shapes.

safetensors is read here; transformers is imported only to write and check an export. Both
are the ``hf`` extra (``pip install 'trainq[hf]'``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint import checkpoint_dirs, latest_checkpoint
from trainer.config import (
    AnyModelConfig,
    ConfigError,
    InitConfig,
    LlamaConfig,
    TrainConfig,
    require_no_links,
    resolve_data_path,
)
from trainer.files import FILE_MODE, make_dirs, set_mode
from trainer.hf_io import (
    CONFIG_FILE,
    EXTRA,
    MODEL_TYPE,
    WEIGHTS,
    config_problems,
    from_hf_state_dict,
    header_shapes,
    hf_config,
    hf_problems,
    listed,
    meta_shapes,
    read_json,
    shape_problems,
    to_hf_state_dict,
    weight_files,
)
from trainer.restore import ATOL, ExportError, checkpoint_config, load_model
from trainer.tokenizer import TOKENIZER_FILE

__all__ = ["check_init", "load_init", "write_hf"]


# -- init sources --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Source:
    label: str  # how messages name it: "models/x", "job 3fa1 step 20"
    folder: Path | None = None  # a Hugging Face folder
    checkpoint: Path | None = None  # a trainq checkpoint, step-N


def _resolve(init: InitConfig, data_root: str | os.PathLike[str] | None, run_dir: Path) -> _Source:
    if init.path is not None:
        folder = resolve_data_path(
            init.path, data_root, allow_absolute=data_root is None, field="init.path"
        )
        if not folder.is_dir():
            raise ConfigError(f"init.path {init.path!r} is not a folder under the data root")
        require_no_links(folder, f"init.path {init.path!r}")
        return _Source(init.path, folder=folder)
    assert init.job is not None  # InitConfig names exactly one
    job_dir = run_dir.parent / init.job
    if job_dir.is_symlink() or (job_dir / "checkpoints").is_symlink():
        raise ConfigError(
            f"init.job {init.job!r}: its run folder is a link; links are not followed"
        )
    if not job_dir.is_dir():
        raise ConfigError(f"init.job {init.job!r}: no such job has a run folder here")
    found = dict(checkpoint_dirs(job_dir))
    if not found:
        raise ConfigError(f"init.job {init.job!r} has no complete checkpoint")
    step = max(found) if init.step is None else init.step
    if step not in found:
        steps = ", ".join(map(str, sorted(found)))
        raise ConfigError(f"init.job {init.job!r} has no checkpoint at step {step} ({steps} only)")
    require_no_links(found[step], f"init.job {init.job!r} step {step}")
    return _Source(f"job {init.job} step {step}", checkpoint=found[step])


def _checkpoint_cfg(source: _Source) -> AnyModelConfig:
    assert source.checkpoint is not None
    try:
        return checkpoint_config(source.checkpoint)[1]
    except (ExportError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
        raise ConfigError(f"init: {source.label}: {str(exc).splitlines()[0]}") from exc


def _checkpoint_problems(cfg: AnyModelConfig, theirs: AnyModelConfig, source: str) -> list[str]:
    if theirs.family != cfg.family:
        return [f"{source} trained family {theirs.family} but this run trains family {cfg.family}"]
    problems = shape_problems(meta_shapes(cfg), meta_shapes(theirs), source)
    fields = ["n_head"]
    if isinstance(cfg, LlamaConfig):
        fields += ["rope_theta", "norm_eps"]
        if cfg.tie_embeddings and isinstance(theirs, LlamaConfig) and not theirs.tie_embeddings:
            problems.append(
                f"{source} has an output matrix of its own, but this model ties it to the "
                "embedding (set model.tie_embeddings: false)"
            )
    for f in fields:
        a, b = getattr(theirs, f, None), getattr(cfg, f, None)
        if a != b:
            problems.append(f"{source} has model.{f} {a} but this run has {b}")
    return problems


def _fail(problems: list[str]) -> None:
    if problems:
        raise ConfigError("init: " + "; ".join(problems))


def check_init(
    cfg: TrainConfig, run_dir: Path, data_root: str | os.PathLike[str] | None
) -> list[str]:
    """The cheap half of `load_init`, run before any process group: the source exists and
    its family, config and tensor shapes fit ``cfg.model`` (read from safetensors headers or
    a checkpoint's meta; nothing loaded). ConfigError says what does not; returns notes
    worth printing. Nothing to check when the run resumes from a checkpoint of its own."""
    if cfg.init is None or latest_checkpoint(run_dir) is not None:
        return []
    source = _resolve(cfg.init, data_root, run_dir)
    if source.folder is None:
        _fail(_checkpoint_problems(cfg.model, _checkpoint_cfg(source), source.label))
        return []
    _no_hf_family(cfg.model)
    problems, notes = config_problems(cfg.model, _hf_config_json(source), source.label)
    _fail(problems)
    shapes: dict[str, tuple[int, ...]] = {}
    for path in weight_files(source.folder, f"init: {source.label}"):
        shapes.update(header_shapes(path, f"init: {source.label}"))
    _fail(hf_problems(cfg.model, shapes, source.label)[0])
    _load_file()  # the extra is there, or the run stops here, before any process group
    return notes


def _load_file() -> Any:
    """safetensors' reader; a worker without the ``hf`` extra: ConfigError naming it."""
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise ConfigError(f"init.path needs safetensors on the worker: {EXTRA}") from None
    return load_file


def _hf_config_json(source: _Source) -> dict[str, Any]:
    assert source.folder is not None
    raw = read_json(source.folder / CONFIG_FILE, f"init: {source.label}")
    return raw if isinstance(raw, dict) else {}


def _no_hf_family(cfg: AnyModelConfig) -> None:
    if cfg.family not in MODEL_TYPE:
        raise ConfigError(
            f"init.path is for families gpt and llama; family {cfg.family} starts from "
            "model.path's own weights (init.job works for every family)"
        )


@torch.no_grad()
def load_init(
    model: Any, init: InitConfig, data_root: str | os.PathLike[str] | None, run_dir: Path
) -> None:
    """Replace the model's weights (built, on the CPU, not yet parallelized) with ``init``'s:
    a Hugging Face folder under ``data_root`` (``init.path``, the escape rules of data
    paths; absolute only without a root) or the checkpoint of job ``init.job`` (a sibling of
    ``run_dir``), at ``init.step`` or its newest, written by any strategy.
    ConfigError for a missing source or anything that does not fit, naming it.

    The torch RNG is left as it was: what is drawn after (LoRA's adapters) is the same
    with or without ``init`` (building the checkpoint's model would draw its weights)."""
    with torch.random.fork_rng(devices=[]):
        _load_init(model, init, data_root, run_dir)


def _load_init(
    model: Any, init: InitConfig, data_root: str | os.PathLike[str] | None, run_dir: Path
) -> None:
    cfg = model.cfg
    source = _resolve(init, data_root, run_dir)
    if source.checkpoint is not None:
        _fail(_checkpoint_problems(cfg, _checkpoint_cfg(source), source.label))
        try:
            theirs, _ = load_model(source.checkpoint.parent.parent, source.checkpoint)
        except ExportError as exc:
            raise ConfigError(f"init: {exc}") from exc
        _load(model, theirs.state_dict(), source.label)
        return
    _no_hf_family(cfg)
    _fail(config_problems(cfg, _hf_config_json(source), source.label)[0])
    load_file = _load_file()
    assert source.folder is not None
    tensors: dict[str, torch.Tensor] = {}
    for path in weight_files(source.folder, f"init: {source.label}"):
        tensors.update(load_file(path, device="cpu"))
    try:
        state = from_hf_state_dict(cfg, tensors, source=source.label)
    except ConfigError as exc:
        raise ConfigError(f"init: {exc}") from exc
    _load(model, state, source.label)  # copy_ casts a bf16/fp16 folder to the model's dtype


def _load(model: Any, state: dict[str, torch.Tensor], source: str) -> None:
    # Every base weight is in ``state`` (checked above); what the model has beyond them
    # (LoRA adapters, when applied before) keeps its own initialization.
    unexpected = model.load_state_dict(state, strict=False).unexpected_keys
    _fail([f"{source} has tensors this model does not: {listed(unexpected)}"] if unexpected else [])


# -- export --------------------------------------------------------------------------------


def _write_text(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    set_mode(fd)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)


# What --format hf writes of a dataset's tokenizer: the file itself and the config that has
# AutoTokenizer load it as a PreTrainedTokenizerFast (no model-specific tokenizer class).
TOKENIZER_CONFIG = "tokenizer_config.json"
_TOKENIZER_FILES = (TOKENIZER_FILE, TOKENIZER_CONFIG)
_TOKENIZER_SAMPLE = "The quick brown fox jumps over the lazy dog.\n  Ünïcödé 0123 <|x|>\n"


def _write_tokenizer(folder: Path, tokenizer: Path | None, seq_len: int) -> str | None:
    """``tokenizer.json`` (a copy) and ``tokenizer_config.json``, or neither (an earlier
    export's would otherwise claim this model); the tokenizer's text."""
    if tokenizer is None:
        for name in _TOKENIZER_FILES:
            (folder / name).unlink(missing_ok=True)
        return None
    try:
        text = tokenizer.read_text(encoding="utf-8")
    except (OSError, ValueError) as exc:
        raise ExportError(f"cannot read the dataset's tokenizer {tokenizer}: {exc}") from None
    _write_text(folder / TOKENIZER_FILE, text)
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": seq_len,
        "clean_up_tokenization_spaces": False,
    }
    _write_text(folder / TOKENIZER_CONFIG, json.dumps(settings, indent=2) + "\n")
    return text


def _check_tokenizer(transformers: Any, folder: Path, text: str) -> None:
    """AutoTokenizer loads the exported tokenizer and encodes as the dataset's did."""
    from tokenizers import Tokenizer

    expected = Tokenizer.from_str(text).encode(_TOKENIZER_SAMPLE, add_special_tokens=False).ids
    try:
        loaded = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
        got = loaded(_TOKENIZER_SAMPLE, add_special_tokens=False)["input_ids"]
    except Exception as exc:  # whatever transformers raises for a file it cannot take
        raise ExportError(f"{folder}: AutoTokenizer cannot load the tokenizer: {exc}") from exc
    if list(got) != list(expected):
        raise ExportError(f"{folder}: AutoTokenizer encodes otherwise than the dataset's tokenizer")


@torch.no_grad()
def write_hf(
    model: Any, folder: Path, *, atol: float = ATOL, tokenizer: Path | None = None
) -> float:
    """Write ``folder`` (config.json, model.safetensors, and with ``tokenizer``, the
    dataset's tokenizer.json, that copied, and a tokenizer_config.json; files 0640, folders
    0750), load it back with ``transformers.AutoModelForCausalLM`` and compare its logits with
    the model's on a fixed batch: the largest absolute difference, ExportError past ``atol``.
    The tokenizer is loaded back with ``AutoTokenizer`` and must encode a sample alike."""
    try:
        import transformers
        from safetensors.torch import save_file
    except ImportError:
        raise ExportError(f"format hf needs transformers and safetensors: {EXTRA}") from None
    cfg = model.cfg
    try:
        fields = dict(hf_config(cfg))
    except ConfigError as exc:
        raise ExportError(str(exc)) from exc
    ours = {CONFIG_FILE, WEIGHTS, *_TOKENIZER_FILES}
    if folder.exists() and (not folder.is_dir() or {p.name for p in folder.iterdir()} - ours):
        raise ExportError(f"{folder} holds more than a previous export; pick a new --out")
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    make_dirs(folder)
    _write_text(folder / CONFIG_FILE, config.to_json_string())
    save_file(to_hf_state_dict(model), str(folder / WEIGHTS), metadata={"format": "pt"})
    os.chmod(folder / WEIGHTS, FILE_MODE)
    tokenizer_text = _write_tokenizer(folder, tokenizer, cfg.seq_len)
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # a bar per load on the export's stderr
    try:
        auto = transformers.AutoModelForCausalLM
        loaded = auto.from_pretrained(folder, local_files_only=True).float().eval()
        if tokenizer_text is not None:
            _check_tokenizer(transformers, folder, tokenizer_text)
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()
    tokens = torch.randint(
        0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0)
    )
    was_training = model.training
    model.eval()
    expected = model(tokens)
    model.train(was_training)
    got = loaded(input_ids=tokens, use_cache=False).logits
    diff = float((got - expected).abs().max())
    if not diff <= atol:
        raise ExportError(
            f"{folder}: transformers' {type(loaded).__name__} gives logits {diff:.2e} away from "
            f"the model's (> {atol:g})"
        )
    return diff
