"""Hugging Face weights in and out for the native families: ``gpt`` <-> ``GPT2LMHeadModel``,
``llama`` <-> ``LlamaForCausalLM``.

Out: `write_hf` writes a folder (config.json, model.safetensors) that
``transformers.AutoModelForCausalLM.from_pretrained`` loads, then loads it back with
transformers and compares logits with the model's (at most 1e-4 apart in fp32 by default;
they agree to the last bit on small models). In: `load_init` starts a run from a Hugging
Face folder under the data root (``init.path``) or from another job's checkpoint
(``init.job``); `check_init` is its cheap half (shapes from the safetensors
headers or the checkpoint's meta, on the meta device), which the trainer runs before any
process group so a misfit is a spec_error naming the tensor and both shapes.

The maps are one table of tensor names (`_pairs`). Llama's rotary embeddings already use
Hugging Face's "rotate half" layout, so its weights move unchanged. Our GPT is GPT-2 with
exact (erf) GELU where GPT-2 has ``gelu_new`` (tanh), so config.json says
``activation_function: gelu``; GPT-2's Conv1D stores weights transposed against
``nn.Linear``, and its fused ``c_attn`` is our ``qkv`` (q, k, v along the output dim).
Tied embeddings are stored once, under the embedding's name, as transformers saves them.

safetensors is read here; transformers is imported only to write and check an export. Both
are the ``hf`` extra (``pip install 'trainq[hf]'``).
"""

from __future__ import annotations

import json
import math
import os
import struct
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
    ModelConfig,
    TrainConfig,
    resolve_data_path,
)
from trainer.export import ATOL, ExportError, checkpoint_config, load_model
from trainer.files import FILE_MODE, make_dirs, set_mode
from trainer.models import build_model

__all__ = [
    "check_init",
    "from_hf_state_dict",
    "hf_config",
    "load_init",
    "to_hf_state_dict",
    "write_hf",
]

EXTRA = "pip install 'trainq[hf]'"
CONFIG_FILE = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
_MODEL_TYPE = {"gpt": "gpt2", "llama": "llama"}
_MAX_HEADER = 100 * 2**20  # a safetensors header is JSON; refuse a corrupt length


@dataclass(frozen=True)
class _Pair:
    ours: str
    hf: str
    transpose: bool = False  # GPT-2's Conv1D: [in, out] where nn.Linear is [out, in]


def _pairs(cfg: AnyModelConfig) -> list[_Pair]:
    """Every distinct tensor of the model, our name and Hugging Face's (a tied head: none)."""
    if isinstance(cfg, LlamaConfig):
        out = [_Pair("tok_embeddings.weight", "model.embed_tokens.weight")]
        for i in range(cfg.n_layer):
            a, b = f"blocks.{i}.", f"model.layers.{i}."
            out += [
                _Pair(f"{a}attention.{ours}.weight", f"{b}self_attn.{hf}_proj.weight")
                for ours, hf in (("wq", "q"), ("wk", "k"), ("wv", "v"), ("wo", "o"))
            ]
            out += [
                _Pair(f"{a}feed_forward.{ours}.weight", f"{b}mlp.{hf}_proj.weight")
                for ours, hf in (("w1", "gate"), ("w3", "up"), ("w2", "down"))
            ]
            out += [
                _Pair(f"{a}attention_norm.weight", f"{b}input_layernorm.weight"),
                _Pair(f"{a}ffn_norm.weight", f"{b}post_attention_layernorm.weight"),
            ]
        out.append(_Pair("norm.weight", "model.norm.weight"))
        if not cfg.tie_embeddings:
            out.append(_Pair("output.weight", "lm_head.weight"))
        return out
    if isinstance(cfg, ModelConfig):
        out = [_Pair("wte.weight", "transformer.wte.weight")]
        out.append(_Pair("wpe.weight", "transformer.wpe.weight"))
        for i in range(cfg.n_layer):
            a, b = f"blocks.{i}.", f"transformer.h.{i}."
            for ours, hf, linear in (
                ("ln1", "ln_1", False),
                ("attn.qkv", "attn.c_attn", True),
                ("attn.proj", "attn.c_proj", True),
                ("ln2", "ln_2", False),
                ("mlp.fc", "mlp.c_fc", True),
                ("mlp.proj", "mlp.c_proj", True),
            ):
                out.append(_Pair(f"{a}{ours}.weight", f"{b}{hf}.weight", transpose=linear))
                out.append(_Pair(f"{a}{ours}.bias", f"{b}{hf}.bias"))
        out += [_Pair(f"ln_f.{p}", f"transformer.ln_f.{p}") for p in ("weight", "bias")]
        return out  # lm_head is wte (always tied)
    raise ConfigError(f"family {cfg.family}: Hugging Face weights map for gpt and llama only")


def _tied(cfg: AnyModelConfig) -> tuple[str, str] | None:
    """(head, embedding), our names, when the model ties them."""
    if isinstance(cfg, ModelConfig):
        return "lm_head.weight", "wte.weight"
    if isinstance(cfg, LlamaConfig) and cfg.tie_embeddings:
        return "output.weight", "tok_embeddings.weight"
    return None


def hf_config(cfg: AnyModelConfig) -> dict[str, Any]:
    """config.json of the model: ``model_type``, ``architectures`` and the keyword
    arguments of transformers' config class (which writes them in its own version's layout).

    No token ids are claimed (bos/eos None): the model knows no tokenizer. GPT-2's dropouts
    are 0, as in our GPT, so transformers trains the same function."""
    if not isinstance(cfg, LlamaConfig | ModelConfig):
        raise ConfigError(f"family {cfg.family}: Hugging Face weights map for gpt and llama only")
    common = {"vocab_size": cfg.vocab_size, "bos_token_id": None, "eos_token_id": None}
    if isinstance(cfg, LlamaConfig):
        return {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            **common,
            "hidden_size": cfg.d_model,
            "intermediate_size": cfg.hidden,
            "num_hidden_layers": cfg.n_layer,
            "num_attention_heads": cfg.n_head,
            "num_key_value_heads": cfg.kv_heads,
            "head_dim": cfg.d_model // cfg.n_head,
            "max_position_embeddings": cfg.seq_len,
            "rope_theta": cfg.rope_theta,
            "rms_norm_eps": cfg.norm_eps,
            "hidden_act": "silu",
            "tie_word_embeddings": cfg.tie_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
        }
    return {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        **common,
        "n_positions": cfg.seq_len,
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": cfg.mlp_ratio * cfg.d_model,
        "activation_function": "gelu",  # exact GELU (erf), not GPT-2's gelu_new
        "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": True,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
    }


def to_hf_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The model's tensors under Hugging Face's names, contiguous CPU copies that share no
    storage (what safetensors writes); a tied head only as the embedding."""
    state = model.state_dict()
    out = {}
    for p in _pairs(model.cfg):
        t = state[p.ours].detach()
        out[p.hf] = (t.t() if p.transpose else t).to("cpu").contiguous().clone()
    return out


def _hf_name(cfg: AnyModelConfig, name: str, prefixed: bool) -> str | None:
    """A stored name as `_pairs` spells it; None for buffers that old exports carry."""
    if name.endswith((".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")):
        return None  # GPT-2's causal mask, Llama's rotary table: recomputed, not weights
    if isinstance(cfg, ModelConfig) and not prefixed and name != "lm_head.weight":
        return f"transformer.{name}"  # OpenAI's gpt2 files name GPT2Model's tensors
    return name


def _normalize(cfg: AnyModelConfig, names: list[str]) -> dict[str, str]:
    prefixed = any(n.startswith("transformer.") for n in names)
    out = {}
    for n in names:
        hf = _hf_name(cfg, n, prefixed)
        if hf is not None:
            out[hf] = n
    return out


def _meta_shapes(cfg: AnyModelConfig) -> dict[str, tuple[int, ...]]:
    """Our state dict's shapes, from a model on the meta device (no memory)."""
    with torch.device("meta"):
        model = build_model(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:4])
    return shown if len(names) <= 4 else f"{shown} and {len(names) - 4} more"


def _shape_problems(
    expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]], source: str
) -> list[str]:
    problems = [
        f"{name} has shape {list(found[name])} in {source} but {list(shape)} in this model"
        for name, shape in expected.items()
        if name in found and found[name] != shape
    ]
    missing = [name for name in expected if name not in found]
    if missing:
        problems.append(f"{source} lacks {_listed(missing)}")
    unexpected = [name for name in found if name not in expected]
    if unexpected:
        problems.append(f"{source} has tensors this model does not: {_listed(unexpected)}")
    return problems


def _hf_problems(
    cfg: AnyModelConfig, shapes: dict[str, tuple[int, ...]], source: str
) -> tuple[list[str], dict[str, str]]:
    """What keeps Hugging Face tensors of these shapes out of the model; and the map from
    `_pairs`' names to the stored ones."""
    names = _normalize(cfg, list(shapes))
    found = {hf: shapes[stored] for hf, stored in names.items()}
    expected = {}
    ours = _meta_shapes(cfg)
    for p in _pairs(cfg):
        shape = ours[p.ours]
        expected[p.hf] = (shape[1], shape[0]) if p.transpose else shape
    tied = _tied(cfg)
    if tied is not None and "lm_head.weight" in found:
        # Some exports store a tied head twice; equal to the embedding it is checked later.
        found.pop("lm_head.weight")
    problems = _shape_problems(expected, found, source)
    if tied is None and "lm_head.weight" not in found:
        problems.append(f"{source} may tie lm_head to the embedding: set model.tie_embeddings")
    return problems, names


def from_hf_state_dict(
    cfg: AnyModelConfig, tensors: dict[str, torch.Tensor], *, source: str = "the weights"
) -> dict[str, torch.Tensor]:
    """Hugging Face tensors (``GPT2LMHeadModel``'s or ``LlamaForCausalLM``'s names) as our
    model's state dict, for ``load_state_dict``. ConfigError names every tensor whose shape
    differs (both shapes), and the missing and unexpected ones."""
    problems, names = _hf_problems(cfg, {k: tuple(v.shape) for k, v in tensors.items()}, source)
    tied = _tied(cfg)
    head = names.get("lm_head.weight")
    if tied is not None and head is not None and not problems:
        embedding = next(names[p.hf] for p in _pairs(cfg) if p.ours == tied[1])
        if not torch.equal(tensors[head], tensors[embedding]):
            problems.append(
                f"{source} has an lm_head.weight of its own, but this model ties it to the "
                "embedding (a Llama: model.tie_embeddings: false)"
            )
    if problems:
        raise ConfigError("; ".join(problems))
    out = {}
    for p in _pairs(cfg):
        t = tensors[names[p.hf]]
        out[p.ours] = t.t() if p.transpose else t
    if tied is not None:
        out[tied[0]] = out[tied[1]]
    return out


# -- Hugging Face folders ------------------------------------------------------------------


def _read_json(path: Path, source: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{source} has no {path.name}") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{source}: {path.name} is unreadable: {exc}") from exc


def _weight_files(folder: Path, source: str) -> list[Path]:
    """model.safetensors, or the shards that model.safetensors.index.json names."""
    if (folder / WEIGHTS).is_file():
        return [folder / WEIGHTS]
    if not (folder / INDEX).is_file():
        other = " (pytorch_model.bin is not read: save it as safetensors)"
        has_bin = (folder / "pytorch_model.bin").is_file()
        raise ConfigError(f"{source} has no {WEIGHTS} or {INDEX}" + (other if has_bin else ""))
    index = _read_json(folder / INDEX, source)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ConfigError(f"{source}: {INDEX} has no weight_map")
    files = []
    for name in sorted({str(v) for v in weight_map.values()}):
        if Path(name).name != name or name.startswith("."):  # a shard beside the index only
            raise ConfigError(f"{source}: {INDEX} names {name!r}, not a file in the folder")
        if not (folder / name).is_file():
            raise ConfigError(f"{source}: {INDEX} names {name}, which is missing")
        files.append(folder / name)
    return files


def _header_shapes(path: Path, source: str) -> dict[str, tuple[int, ...]]:
    """Tensor shapes from a safetensors file's header (8-byte length, then JSON): no data read."""
    try:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > _MAX_HEADER:
                raise ValueError(f"header length {length}")
            header = json.loads(f.read(length))
        return {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}
    except (OSError, ValueError, struct.error, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"{source}: {path.name} is not a safetensors file ({exc})") from exc


def _config_problems(
    cfg: AnyModelConfig, hfc: dict[str, Any], source: str
) -> tuple[list[str], list[str]]:
    """What in a config.json makes another function than this model's, though the shapes
    may fit (heads, rotary base, norms, activation); and notes that do not stop a run."""
    kind, wanted = hfc.get("model_type"), _MODEL_TYPE.get(cfg.family)
    if kind != wanted:
        return [
            f"{source} is a {kind!r} model (config.json model_type) but this run trains family "
            f"{cfg.family}, which reads {wanted!r} models"
        ], []
    problems: list[str] = []
    notes: list[str] = []

    def differs(key: str, theirs: Any, field: str, ours: Any) -> None:
        same = (
            math.isclose(float(theirs), float(ours), rel_tol=1e-9)
            if isinstance(theirs, int | float) and isinstance(ours, int | float)
            else theirs == ours
        )
        if not same:
            problems.append(f"{source} has {key} {theirs} (config.json) but {field} is {ours}")

    if isinstance(cfg, LlamaConfig):
        rope = hfc.get("rope_parameters") or hfc.get("rope_scaling") or {}
        theta = rope.get("rope_theta", hfc.get("rope_theta", 10000.0))
        scaling = rope.get("rope_type", rope.get("type", "default"))
        if scaling not in (None, "default"):
            problems.append(f"{source} scales its rotary embeddings ({scaling}); trainq's do not")
        differs("num_attention_heads", hfc.get("num_attention_heads"), "model.n_head", cfg.n_head)
        differs("rope_theta", theta, "model.rope_theta", cfg.rope_theta)
        differs("rms_norm_eps", hfc.get("rms_norm_eps", 1e-6), "model.norm_eps", cfg.norm_eps)
        tie = hfc.get("tie_word_embeddings", False)
        differs("tie_word_embeddings", tie, "model.tie_embeddings", cfg.tie_embeddings)
        act = hfc.get("hidden_act", "silu")
        if act != "silu":
            problems.append(f"{source} has hidden_act {act!r}; trainq's Llama has silu")
    elif isinstance(cfg, ModelConfig):
        differs("n_head", hfc.get("n_head"), "model.n_head", cfg.n_head)
        eps = hfc.get("layer_norm_epsilon", 1e-5)
        if not isinstance(eps, int | float) or not math.isclose(eps, 1e-5, rel_tol=1e-9):
            problems.append(f"{source} has layer_norm_epsilon {eps}; trainq's GPT has 1e-05")
        act = hfc.get("activation_function", "gelu_new")
        if act in ("gelu_new", "gelu_pytorch_tanh"):
            notes.append(
                f"init: {source} uses {act} (tanh GELU); trainq's GPT computes exact GELU, "
                "a slightly different function that fine-tuning adapts to"
            )
        elif act != "gelu":
            problems.append(f"{source} has activation_function {act!r}; trainq's GPT has gelu")
        if not hfc.get("tie_word_embeddings", True):
            problems.append(f"{source} unties lm_head from wte; trainq's GPT ties them")
        if hfc.get("scale_attn_by_inverse_layer_idx"):
            problems.append(f"{source} scales attention by layer (scale_attn_by_inverse_layer_idx)")
    return problems, notes


# -- init sources --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Source:
    label: str  # how messages name it: "models/x", "job 3fa1 step 20"
    folder: Path | None = None  # a Hugging Face folder
    checkpoint: Path | None = None  # a trainq checkpoint, step-N


def _resolve(init: InitConfig, data_root: str | os.PathLike[str] | None, run_dir: Path) -> _Source:
    if init.path is not None:
        try:
            folder = resolve_data_path(init.path, data_root, allow_absolute=data_root is None)
        except ConfigError as exc:
            raise ConfigError(str(exc).replace("data.path", "init.path", 1)) from None
        if not folder.is_dir():
            raise ConfigError(f"init.path {init.path!r} is not a folder under the data root")
        return _Source(init.path, folder=folder)
    assert init.job is not None  # InitConfig names exactly one
    job_dir = run_dir.parent / init.job
    if not job_dir.is_dir():
        raise ConfigError(f"init.job {init.job!r}: no such job has a run folder here")
    found = dict(checkpoint_dirs(job_dir))
    if not found:
        raise ConfigError(f"init.job {init.job!r} has no complete checkpoint")
    step = max(found) if init.step is None else init.step
    if step not in found:
        steps = ", ".join(map(str, sorted(found)))
        raise ConfigError(f"init.job {init.job!r} has no checkpoint at step {step} ({steps} only)")
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
    problems = _shape_problems(_meta_shapes(cfg), _meta_shapes(theirs), source)
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
    problems, notes = _config_problems(cfg.model, _hf_config_json(source), source.label)
    _fail(problems)
    shapes: dict[str, tuple[int, ...]] = {}
    for path in _weight_files(source.folder, f"init: {source.label}"):
        shapes.update(_header_shapes(path, f"init: {source.label}"))
    _fail(_hf_problems(cfg.model, shapes, source.label)[0])
    return notes


def _hf_config_json(source: _Source) -> dict[str, Any]:
    assert source.folder is not None
    raw = _read_json(source.folder / CONFIG_FILE, f"init: {source.label}")
    return raw if isinstance(raw, dict) else {}


def _no_hf_family(cfg: AnyModelConfig) -> None:
    if cfg.family not in _MODEL_TYPE:
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
    _fail(_config_problems(cfg, _hf_config_json(source), source.label)[0])
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise ConfigError(f"init.path needs safetensors on the worker: {EXTRA}") from None
    assert source.folder is not None
    tensors: dict[str, torch.Tensor] = {}
    for path in _weight_files(source.folder, f"init: {source.label}"):
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
    _fail(
        [f"{source} has tensors this model does not: {_listed(unexpected)}"] if unexpected else []
    )


# -- export --------------------------------------------------------------------------------


def _write_text(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    set_mode(fd)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)


@torch.no_grad()
def write_hf(model: Any, folder: Path, *, atol: float = ATOL) -> float:
    """Write ``folder`` (config.json, model.safetensors; files 0640, folders 0750), load it
    back with ``transformers.AutoModelForCausalLM`` and compare its logits with the model's
    on a fixed batch: the largest absolute difference, ExportError past ``atol``."""
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
    ours = {CONFIG_FILE, WEIGHTS}
    if folder.exists() and (not folder.is_dir() or {p.name for p in folder.iterdir()} - ours):
        raise ExportError(f"{folder} holds more than a previous export; pick a new --out")
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    make_dirs(folder)
    _write_text(folder / CONFIG_FILE, config.to_json_string())
    save_file(to_hf_state_dict(model), str(folder / WEIGHTS), metadata={"format": "pt"})
    os.chmod(folder / WEIGHTS, FILE_MODE)
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # a bar per load on the export's stderr
    try:
        auto = transformers.AutoModelForCausalLM
        loaded = auto.from_pretrained(folder, local_files_only=True).float().eval()
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
