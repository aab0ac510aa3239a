"""Hugging Face's side of the native families' weights: tensor names, config.json and
safetensors folders, for ``gpt`` <-> ``GPT2LMHeadModel``, ``llama`` <-> ``LlamaForCausalLM``
and ``moe`` <-> ``MixtralForCausalLM`` (trainer.hf moves weights in and out with them).
Mixtral's files hold one tensor per expert (``block_sparse_moe.experts.{e}.w1.weight``, the
layout transformers saves and the Hub's checkpoints have) where ours stacks them
(``feed_forward.w1.weight`` ``[E, out, in]``): a `Pair` with an ``expert`` is one slice.

The maps are one table of tensor names (`pairs`). Llama's rotary embeddings already use
Hugging Face's "rotate half" layout, so its weights move unchanged. Our GPT is GPT-2 with
exact (erf) GELU where GPT-2 has ``gelu_new`` (tanh), so config.json says
``activation_function: gelu``; GPT-2's Conv1D stores weights transposed against
``nn.Linear``, and its fused ``c_attn`` is our ``qkv`` (q, k, v along the output dim).
Tied embeddings are stored once, under the embedding's name, as transformers saves them.

A folder is read without transformers: config.json as JSON, tensor shapes from the
safetensors headers (no data read), so a misfit is found before anything is loaded.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.config import AnyModelConfig, ConfigError, LlamaConfig, ModelConfig, MoeConfig
from trainer.models import build_model

__all__ = [
    "config_problems",
    "from_hf_state_dict",
    "header_shapes",
    "hf_config",
    "hf_problems",
    "to_hf_state_dict",
    "weight_files",
]

EXTRA = "pip install 'trainq[hf]'"
CONFIG_FILE = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
MODEL_TYPE = {"gpt": "gpt2", "llama": "llama", "moe": "mixtral"}
_MAX_HEADER = 100 * 2**20  # a safetensors header is JSON; refuse a corrupt length


@dataclass(frozen=True)
class Pair:
    ours: str
    hf: str
    transpose: bool = False  # GPT-2's Conv1D: [in, out] where nn.Linear is [out, in]
    expert: int | None = None  # moe: this expert's slice of our stacked tensor


def pairs(cfg: AnyModelConfig) -> list[Pair]:
    """Every distinct tensor of the model, our name and Hugging Face's (a tied head: none)."""
    if isinstance(cfg, LlamaConfig):
        out = [Pair("tok_embeddings.weight", "model.embed_tokens.weight")]
        for i in range(cfg.n_layer):
            a, b = f"blocks.{i}.", f"model.layers.{i}."
            out += [
                Pair(f"{a}attention.{ours}.weight", f"{b}self_attn.{hf}_proj.weight")
                for ours, hf in (("wq", "q"), ("wk", "k"), ("wv", "v"), ("wo", "o"))
            ]
            if isinstance(cfg, MoeConfig):
                moe = f"{b}block_sparse_moe."
                out.append(Pair(f"{a}feed_forward.router.weight", f"{moe}gate.weight"))
                out += [
                    Pair(f"{a}feed_forward.{w}.weight", f"{moe}experts.{e}.{w}.weight", expert=e)
                    for e in range(cfg.n_experts)
                    for w in ("w1", "w2", "w3")
                ]
            else:
                out += [
                    Pair(f"{a}feed_forward.{ours}.weight", f"{b}mlp.{hf}_proj.weight")
                    for ours, hf in (("w1", "gate"), ("w3", "up"), ("w2", "down"))
                ]
            out += [
                Pair(f"{a}attention_norm.weight", f"{b}input_layernorm.weight"),
                Pair(f"{a}ffn_norm.weight", f"{b}post_attention_layernorm.weight"),
            ]
        out.append(Pair("norm.weight", "model.norm.weight"))
        if not cfg.tie_embeddings:
            out.append(Pair("output.weight", "lm_head.weight"))
        return out
    if isinstance(cfg, ModelConfig):
        out = [Pair("wte.weight", "transformer.wte.weight")]
        out.append(Pair("wpe.weight", "transformer.wpe.weight"))
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
                out.append(Pair(f"{a}{ours}.weight", f"{b}{hf}.weight", transpose=linear))
                out.append(Pair(f"{a}{ours}.bias", f"{b}{hf}.bias"))
        out += [Pair(f"ln_f.{p}", f"transformer.ln_f.{p}") for p in ("weight", "bias")]
        return out  # lm_head is wte (always tied)
    raise ConfigError(f"family {cfg.family}: Hugging Face weights map for gpt, llama and moe")


def tied_names(cfg: AnyModelConfig) -> tuple[str, str] | None:
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
        raise ConfigError(f"family {cfg.family}: Hugging Face weights map for gpt, llama and moe")
    common = {"vocab_size": cfg.vocab_size, "bos_token_id": None, "eos_token_id": None}
    if isinstance(cfg, LlamaConfig):  # moe: Llama blocks whose feed-forward is experts
        llama = {
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
        }
        if isinstance(cfg, MoeConfig):
            return {
                "model_type": "mixtral",
                "architectures": ["MixtralForCausalLM"],
                **llama,
                "num_local_experts": cfg.n_experts,
                "num_experts_per_tok": cfg.top_k,
                "router_aux_loss_coef": cfg.aux_loss_coef,
                "router_jitter_noise": 0.0,
                "sliding_window": None,
            }
        return {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            **llama,
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
    for p in pairs(model.cfg):
        t = state[p.ours].detach()
        t = t[p.expert] if p.expert is not None else t
        out[p.hf] = (t.t() if p.transpose else t).to("cpu").contiguous().clone()
    return out


def _hf_name(cfg: AnyModelConfig, name: str, prefixed: bool) -> str | None:
    """A stored name as `pairs` spells it; None for buffers that old exports carry."""
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


def meta_shapes(cfg: AnyModelConfig) -> dict[str, tuple[int, ...]]:
    """Our state dict's shapes, from a model on the meta device (no memory)."""
    with torch.device("meta"):
        model = build_model(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def listed(names: list[str]) -> str:
    shown = ", ".join(names[:4])
    return shown if len(names) <= 4 else f"{shown} and {len(names) - 4} more"


def shape_problems(
    expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]], source: str
) -> list[str]:
    problems = [
        f"{name} has shape {list(found[name])} in {source} but {list(shape)} in this model"
        for name, shape in expected.items()
        if name in found and found[name] != shape
    ]
    missing = [name for name in expected if name not in found]
    if missing:
        problems.append(f"{source} lacks {listed(missing)}")
    unexpected = [name for name in found if name not in expected]
    if unexpected:
        problems.append(f"{source} has tensors this model does not: {listed(unexpected)}")
    return problems


def hf_problems(
    cfg: AnyModelConfig, shapes: dict[str, tuple[int, ...]], source: str
) -> tuple[list[str], dict[str, str]]:
    """What keeps Hugging Face tensors of these shapes out of the model; and the map from
    `pairs`' names to the stored ones."""
    names = _normalize(cfg, list(shapes))
    found = {hf: shapes[stored] for hf, stored in names.items()}
    expected = {}
    ours = meta_shapes(cfg)
    for p in pairs(cfg):
        shape = ours[p.ours] if p.expert is None else ours[p.ours][1:]
        expected[p.hf] = (shape[1], shape[0]) if p.transpose else shape
    tied = tied_names(cfg)
    if tied is not None and "lm_head.weight" in found:
        # Some exports store a tied head twice; equal to the embedding it is checked later.
        found.pop("lm_head.weight")
    problems = shape_problems(expected, found, source)
    if tied is None and "lm_head.weight" not in found:
        problems.append(f"{source} may tie lm_head to the embedding: set model.tie_embeddings")
    return problems, names


def from_hf_state_dict(
    cfg: AnyModelConfig, tensors: dict[str, torch.Tensor], *, source: str = "the weights"
) -> dict[str, torch.Tensor]:
    """Hugging Face tensors (``GPT2LMHeadModel``'s or ``LlamaForCausalLM``'s names) as our
    model's state dict, for ``load_state_dict``. ConfigError names every tensor whose shape
    differs (both shapes), and the missing and unexpected ones."""
    problems, names = hf_problems(cfg, {k: tuple(v.shape) for k, v in tensors.items()}, source)
    tied = tied_names(cfg)
    head = names.get("lm_head.weight")
    if tied is not None and head is not None and not problems:
        embedding = next(names[p.hf] for p in pairs(cfg) if p.ours == tied[1])
        if not torch.equal(tensors[head], tensors[embedding]):
            problems.append(
                f"{source} has an lm_head.weight of its own, but this model ties it to the "
                "embedding (a Llama: model.tie_embeddings: false)"
            )
    if problems:
        raise ConfigError("; ".join(problems))
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, list[torch.Tensor]] = {}
    for p in pairs(cfg):
        t = tensors[names[p.hf]]
        if p.expert is not None:  # in expert order (pairs lists them so)
            experts.setdefault(p.ours, []).append(t)
            continue
        out[p.ours] = t.t() if p.transpose else t
    out.update({name: torch.stack(ts) for name, ts in experts.items()})
    if tied is not None:
        out[tied[0]] = out[tied[1]]
    return out


# -- Hugging Face folders ------------------------------------------------------------------


def read_json(path: Path, source: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{source} has no {path.name}") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{source}: {path.name} is unreadable: {exc}") from exc


def weight_files(folder: Path, source: str) -> list[Path]:
    """model.safetensors, or the shards that model.safetensors.index.json names."""
    if (folder / WEIGHTS).is_file():
        return [folder / WEIGHTS]
    if not (folder / INDEX).is_file():
        other = " (pytorch_model.bin is not read: save it as safetensors)"
        has_bin = (folder / "pytorch_model.bin").is_file()
        raise ConfigError(f"{source} has no {WEIGHTS} or {INDEX}" + (other if has_bin else ""))
    index = read_json(folder / INDEX, source)
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


def header_shapes(path: Path, source: str) -> dict[str, tuple[int, ...]]:
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


def config_problems(
    cfg: AnyModelConfig, hfc: dict[str, Any], source: str
) -> tuple[list[str], list[str]]:
    """What in a config.json makes another function than this model's, though the shapes
    may fit (heads, rotary base, norms, activation); and notes that do not stop a run."""
    kind, wanted = hfc.get("model_type"), MODEL_TYPE.get(cfg.family)
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
        if isinstance(cfg, MoeConfig):
            differs("num_experts_per_tok", hfc.get("num_experts_per_tok"), "model.top_k", cfg.top_k)
            if hfc.get("sliding_window") is not None:
                problems.append(f"{source} attends in a sliding window; trainq's moe does not")
            if hfc.get("router_jitter_noise"):
                notes.append(f"init: {source} trained with router jitter; trainq routes without")
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
