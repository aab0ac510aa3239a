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

import copy
import importlib.util
import json
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from trainer.checkpoint import checkpoint_dirs, latest_checkpoint
from trainer.config import (
    AnyModelConfig,
    ConfigError,
    InitConfig,
    LlamaConfig,
    LoraConfig,
    TrainConfig,
    require_no_links,
    resolve_data_path,
)
from trainer.files import FILE_MODE, make_dirs, set_mode
from trainer.hf_io import (
    CONFIG_FILE,
    EXTRA,
    INDEX,
    MODEL_TYPE,
    WEIGHTS,
    config_problems,
    from_hf_state_dict,
    header_shapes,
    hf_config,
    hf_problems,
    listed,
    meta_shapes,
    pairs,
    read_json,
    shape_problems,
    to_hf_state_dict,
    weight_files,
)
from trainer.lora import LoRALinear, drop_lora
from trainer.models import vocab_size
from trainer.restore import ATOL, ExportError, checkpoint_config, load_model
from trainer.tokenizer import BYTE, TOKENIZER_FILE, Special, chat_template, special_tokens

__all__ = ["byte_level_tokenizer", "check_init", "load_init", "write_hf", "write_peft"]


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
        fields += ["rope_theta", "norm_eps", *(["top_k"] if cfg.family == "moe" else [])]
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


def _write_json(path: Path, value: Any) -> None:
    _write_text(path, json.dumps(value, indent=2, ensure_ascii=False) + "\n")


# What an export writes of the run's tokenizer: the file itself, the config that has
# AutoTokenizer load it as a PreTrainedTokenizerFast (no model-specific tokenizer class) with
# its special tokens, and the generation settings that make ``generate`` stop at its eos.
TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"
_TOKENIZER_FILES = (TOKENIZER_FILE, TOKENIZER_CONFIG)
# Checked on load-back: ASCII, accents, CJK, an emoji (4 UTF-8 bytes), tabs, runs of spaces.
TOKENIZER_SAMPLE = "The quick brown fox.\n  Ünïcödé héllo wörld 你好 🎉\n\t  spaces <|x|> 0123\n"

# What an export of a native model or an adapter may find in its folder from an earlier one.
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_SHARD = re.compile(r"model-[0-9]{5}-of-[0-9]{5}\.safetensors")
_OURS = {
    CONFIG_FILE,
    WEIGHTS,
    INDEX,
    GENERATION_CONFIG,
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    *_TOKENIZER_FILES,
}

Tokenizer = Path | Literal["byte"] | None  # a tokenizer.json, byte-level, or none known


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map of the 256 byte values to printable characters (tokenizers' ByteLevel)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def byte_level_tokenizer() -> str:
    """The tokenizer.json of trainq's byte-level datasets: 256 tokens, id == byte value, no
    merges, no unk, no normalizer and no prefix space, so any UTF-8 text encodes to its bytes
    and decodes back exactly (a BPE model without merges over tokenizers' ByteLevel maps)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: b for b, char in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return str(tok.to_str())


@dataclass(frozen=True)
class _Tok:
    """What an export writes of a tokenizer: its tokenizer.json and its special tokens."""

    text: str
    specials: dict[str, Special]
    byte: bool
    chat_template: str | None = None  # the dataset's tokenizer_config.json's


def _read_tokenizer(tokenizer: Tokenizer) -> _Tok | None:
    if tokenizer is None:
        return None
    if tokenizer == BYTE:
        return _Tok(byte_level_tokenizer(), {}, True)
    path = Path(tokenizer)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, ValueError) as exc:
        raise ExportError(f"cannot read the dataset's tokenizer {path}: {exc}") from None
    return _Tok(text, special_tokens(path), False, chat_template(path))


def _token_ids(specials: dict[str, Special]) -> dict[str, int | None]:
    """config.json's and generation_config.json's ids; pad falls back to eos."""
    ids: dict[str, int | None] = {f"{r}_token_id": s.id for r, s in specials.items()}
    eos = ids.get("eos_token_id")
    return {
        "bos_token_id": None,
        "eos_token_id": None,
        **ids,
        "pad_token_id": ids.get("pad_token_id", eos),
    }


def _write_tokenizer(folder: Path, tok: _Tok | None, seq_len: int) -> None:
    """``tokenizer.json`` and ``tokenizer_config.json`` (with bos/eos/pad), and
    ``generation_config.json`` when it has special tokens; or none of them (an earlier
    export's would otherwise claim this model)."""
    if tok is None:
        for name in _TOKENIZER_FILES:
            (folder / name).unlink(missing_ok=True)
        return
    _write_text(folder / TOKENIZER_FILE, tok.text)
    settings: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": seq_len,
        "clean_up_tokenization_spaces": False,
        **{f"{role}_token": s.content for role, s in tok.specials.items()},
    }
    if tok.byte:
        # Byte-level data has no end-of-text token. Tools that need one special token (lm-eval's
        # hf backend takes bos or eos as its loglikelihood prefix, and asserts without one)
        # get NUL, byte 0 (id 0, written as the vocabulary spells it), which text never holds;
        # config.json and generation_config.json declare no eos, so generate does not stop at
        # it, as trainq's own generation does not.
        settings["eos_token"] = _bytes_to_unicode()[0]
    if tok.chat_template is not None:  # the model is served and chatted with as it trained
        settings["chat_template"] = tok.chat_template
    _write_json(folder / TOKENIZER_CONFIG, settings)


def _set_ids(fields: dict[str, Any], tok: _Tok) -> None:
    for key, value in _token_ids(tok.specials).items():
        if value is None:
            fields.pop(key, None)
        else:
            fields[key] = value


def _own_config_ids(folder: Path, tok: _Tok | None) -> None:
    """Family hf: config.json's token ids are the run's tokenizer's, not the original
    model's (whose ids may not even be in this vocabulary)."""
    if tok is None:
        return
    path = folder / CONFIG_FILE
    fields = json.loads(path.read_text(encoding="utf-8"))
    _set_ids(fields, tok)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        fields.setdefault(key, None)
    _write_json(path, fields)


def _write_generation_config(folder: Path, tok: _Tok | None) -> None:
    """generation_config.json with the tokenizer's bos/eos/pad ids (those it lacks removed:
    a byte-level run has none), over what is there (family hf: what its save_pretrained
    wrote, kept as it is when the tokenizer is not known); removed when nothing is left."""
    path = folder / GENERATION_CONFIG
    try:
        current = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError):
        current = {}
    current = current if isinstance(current, dict) else {}
    if tok is not None:
        _set_ids(current, tok)
        current.pop("_from_model_config", None)  # else generate re-derives it from config.json
    if not set(current) - {"transformers_version", "_from_model_config"}:
        path.unlink(missing_ok=True)
        return
    _write_json(path, current)


def _check_tokenizer(transformers: Any, folder: Path, tok: _Tok) -> None:
    """AutoTokenizer loads the exported tokenizer, encodes as the dataset's did (byte-level:
    the UTF-8 bytes), decodes a byte-level encoding back exactly, and has its special tokens."""
    from tokenizers import Tokenizer

    if tok.byte:
        expected = list(TOKENIZER_SAMPLE.encode("utf-8"))
    else:
        expected = (
            Tokenizer.from_str(tok.text).encode(TOKENIZER_SAMPLE, add_special_tokens=False).ids
        )
    try:
        loaded = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
        got = loaded(TOKENIZER_SAMPLE, add_special_tokens=False)["input_ids"]
        back = loaded.decode(got)
    except Exception as exc:  # whatever transformers raises for a file it cannot take
        raise ExportError(f"{folder}: AutoTokenizer cannot load the tokenizer: {exc}") from exc
    if list(got) != list(expected):
        raise ExportError(f"{folder}: AutoTokenizer encodes otherwise than the dataset's tokenizer")
    if tok.byte and back != TOKENIZER_SAMPLE:
        raise ExportError(f"{folder}: the byte-level tokenizer does not decode its text back")
    for role, s in tok.specials.items():
        if getattr(loaded, f"{role}_token_id", None) != s.id:
            raise ExportError(f"{folder}: AutoTokenizer does not take {s.content!r} as {role}")


def _clear(folder: Path) -> None:
    """Make ``folder`` (0750), refusing one that holds more than an earlier export."""

    def ours(name: str) -> bool:
        return name in _OURS or _SHARD.fullmatch(name) is not None

    if folder.exists() and (not folder.is_dir() or not all(ours(p.name) for p in folder.iterdir())):
        raise ExportError(f"{folder} holds more than a previous export; pick a new --out")
    make_dirs(folder)
    for p in folder.iterdir():  # a model of another layout (sharded, an adapter) goes
        if p.name not in _TOKENIZER_FILES:
            p.unlink()


def _transformers() -> tuple[Any, Any]:
    try:
        import transformers
        from safetensors.torch import save_file
    except ImportError:
        raise ExportError(f"format hf needs transformers and safetensors: {EXTRA}") from None
    return transformers, save_file


def _native_config(transformers: Any, cfg: AnyModelConfig, tok: _Tok | None) -> Any:
    """transformers' config of a native model, with the tokenizer's token ids."""
    try:
        fields = dict(hf_config(cfg))
    except ConfigError as exc:
        raise ExportError(str(exc)) from exc
    if tok is not None:
        fields.update(_token_ids(tok.specials))
    return transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)


def _quiet_load(transformers: Any, load: Any) -> Any:
    """``load()`` without transformers' progress bars on the export's stderr."""
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    try:
        return load()
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()


def _sample(cfg: AnyModelConfig) -> torch.Tensor:
    return torch.randint(
        0, vocab_size(cfg), (2, cfg.seq_len), generator=torch.Generator().manual_seed(0)
    )


def _logits(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    was_training = model.training
    model.eval()
    try:
        return model(tokens)
    finally:
        model.train(was_training)


def _chmod_tree(folder: Path) -> None:
    for p in folder.iterdir():
        if p.is_file() and not p.is_symlink():
            os.chmod(p, FILE_MODE)


@torch.no_grad()
def write_hf(model: Any, folder: Path, *, atol: float = ATOL, tokenizer: Tokenizer = None) -> float:
    """Write ``folder`` (files 0640, folders 0750): config.json and model.safetensors (the
    native families through trainer.hf_io's map; family ``hf`` with the model's own
    ``save_pretrained``), and with ``tokenizer`` (a tokenizer.json, or ``"byte"`` for
    trainq's byte-level one) tokenizer.json, tokenizer_config.json and, when it has an eos,
    generation_config.json. It is loaded back with ``transformers.AutoModelForCausalLM`` and
    its logits compared with the model's on a fixed batch: the largest absolute difference,
    ExportError past ``atol``. The tokenizer is loaded back with ``AutoTokenizer`` and must
    encode a multilingual sample alike (byte-level: to its bytes, and back exactly)."""
    transformers, save_file = _transformers()
    cfg = model.cfg
    tok = _read_tokenizer(tokenizer)
    config = None if cfg.family == "hf" else _native_config(transformers, cfg, tok)
    _clear(folder)
    if config is None:
        model.inner.save_pretrained(folder)
        _own_config_ids(folder, tok)
    else:
        _write_text(folder / CONFIG_FILE, config.to_json_string())
        save_file(to_hf_state_dict(model), str(folder / WEIGHTS), metadata={"format": "pt"})
    _write_tokenizer(folder, tok, cfg.seq_len)
    _write_generation_config(folder, tok)
    _chmod_tree(folder)

    def load() -> Any:
        auto = transformers.AutoModelForCausalLM
        loaded = auto.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
        if tok is not None:
            _check_tokenizer(transformers, folder, tok)
        return loaded.eval()

    loaded = _quiet_load(transformers, load)
    tokens = _sample(cfg)
    diff = float(
        (loaded(input_ids=tokens, use_cache=False).logits - _logits(model, tokens)).abs().max()
    )
    if not diff <= atol:
        raise ExportError(
            f"{folder}: transformers' {type(loaded).__name__} gives logits {diff:.2e} away from "
            f"the model's (> {atol:g})"
        )
    return diff


# -- PEFT adapters -------------------------------------------------------------------------


def _module_names(model: Any) -> dict[str, tuple[str, bool]]:
    """Our module name -> (transformers' module name, whether its weight is stored
    transposed: GPT-2's Conv1D, PEFT's ``fan_in_fan_out``), for every linear of the model."""
    if model.cfg.family == "hf":
        return {
            name: (name.removeprefix("inner."), False)
            for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and name.startswith("inner.")
        }
    try:
        mapped = pairs(model.cfg)
    except ConfigError as exc:
        raise ExportError(str(exc)) from exc
    return {
        p.ours.removesuffix(".weight"): (p.hf.removesuffix(".weight"), p.transpose)
        for p in mapped
        if p.ours.endswith(".weight")
    }


def _target_modules(adapted: list[str], base_names: list[str]) -> list[str]:
    """PEFT's ``target_modules``: the adapted modules' last names when they pick exactly the
    adapted ones in the base, else their full names."""
    short = sorted({n.rsplit(".", 1)[-1] for n in adapted})
    picked = {n for n in base_names if n.rsplit(".", 1)[-1] in short}
    return short if picked == set(adapted) else sorted(adapted)


def _hf_base(transformers: Any, model: Any) -> Any:
    """The model without its adapters as a transformers model (what a PEFT adapter of it is
    loaded on), built in memory; ``model`` is left as it was."""
    base = copy.deepcopy(model)
    drop_lora(base)
    if base.cfg.family == "hf":
        return base.inner.eval()
    config = _native_config(transformers, base.cfg, None)
    # Loaded as from_pretrained loads a folder: the file layout (to_hf_state_dict's) turned
    # into the modules' own where they differ (transformers 5's Mixtral fuses its experts).
    cls = getattr(transformers, config.architectures[0])
    state = to_hf_state_dict(base)

    def load() -> Any:
        return cls.from_pretrained(
            None, config=config, state_dict=state, dtype=torch.float32, output_loading_info=True
        )

    hf, info = _quiet_load(transformers, load)
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise ExportError(f"the base model lacks {listed(missing)} in transformers' layout")
    return hf.eval()


def peft_config(model: Any, lora: LoraConfig, base_name: str | None) -> dict[str, Any]:
    """adapter_config.json of the model's adapters (PEFT's LoraConfig fields)."""
    names = _module_names(model)
    adapted = [n for n, m in model.named_modules() if isinstance(m, LoRALinear)]
    unknown = [n for n in adapted if n not in names]
    if unknown:
        raise ExportError(f"adapted layers without a transformers name: {listed(unknown)}")
    hf_adapted = [names[n][0] for n in adapted]
    base_names = [hf for hf, _ in names.values()]
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_name,
        "r": lora.rank,
        "lora_alpha": int(lora.alpha) if float(lora.alpha).is_integer() else lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": _target_modules(hf_adapted, base_names),
        "fan_in_fan_out": any(names[n][1] for n in adapted),
        "bias": "none",
        "use_rslora": False,  # scaling = lora_alpha / r, as trainer.lora scales
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }


def peft_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The adapters under PEFT's names: ``base_model.model.<module>.lora_A.weight`` ([r,
    in]: our lora_a) and ``lora_B.weight`` ([out, r]: our lora_b), whatever the layout of
    the base weight (PEFT's lora_A/lora_B are nn.Linear even on GPT-2's Conv1D)."""
    names = _module_names(model)
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear):
            hf = names[name][0]
            for ours, theirs in ((m.lora_a, "lora_A"), (m.lora_b, "lora_B")):
                key = f"base_model.model.{hf}.{theirs}.weight"
                out[key] = ours.detach().to("cpu").contiguous().clone()
    return out


@torch.no_grad()
def write_peft(
    model: Any,
    folder: Path,
    lora: LoraConfig,
    *,
    base_name: str | None = None,
    atol: float = ATOL,
    tokenizer: Tokenizer = None,
) -> float:
    """Write ``folder`` as PEFT writes a LoRA adapter: adapter_config.json and
    adapter_model.safetensors (``model`` with its adapters, not merged), and the run's
    tokenizer as `write_hf` does. When peft is installed, the folder is loaded back with
    ``PeftModel.from_pretrained`` on the base (the model without its adapters, in
    transformers' layout) and its logits compared with the model's: the largest absolute
    difference, ExportError past ``atol``; NaN when peft is not there to check."""
    transformers, save_file = _transformers()
    if not any(isinstance(m, LoRALinear) for m in model.modules()):
        raise ExportError("format peft is for LoRA runs: this checkpoint has no adapters")
    cfg = model.cfg
    tok = _read_tokenizer(tokenizer)
    settings = peft_config(model, lora, base_name)
    tensors = peft_state_dict(model)
    _clear(folder)
    _write_json(folder / ADAPTER_CONFIG, settings)
    save_file(tensors, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    _write_tokenizer(folder, tok, cfg.seq_len)
    _chmod_tree(folder)
    if tok is not None:
        _quiet_load(transformers, lambda: _check_tokenizer(transformers, folder, tok))
    if importlib.util.find_spec("peft") is None:
        return float("nan")  # written, not checked
    from peft import PeftModel

    base = _hf_base(transformers, model)
    try:
        with warnings.catch_warnings():  # peft asks transformers a deprecated question
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing`", FutureWarning)
            adapted = PeftModel.from_pretrained(base, folder, is_trainable=False).eval()
    except Exception as exc:  # whatever peft raises for a folder it cannot take
        raise ExportError(f"{folder}: PeftModel cannot load the adapter: {exc}") from exc
    tokens = _sample(cfg)
    got = adapted(input_ids=tokens, use_cache=False).logits
    diff = float((got - _logits(model, tokens)).abs().max())
    if not diff <= atol:
        raise ExportError(
            f"{folder}: PEFT's adapter on the base gives logits {diff:.2e} away from the "
            f"model's (> {atol:g})"
        )
    return diff
