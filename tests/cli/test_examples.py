"""Every example spec is a valid job spec, and README's spec reference covers every field."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin

import pytest
import yaml
from pydantic import BaseModel, Tag

from service.api.jobs.schemas import JobSpec
from service.local.demo import demo_spec
from trainer.config import TrainConfig

REPO = Path(__file__).resolve().parents[2]
SWEEPS = [REPO / "examples" / "sweep.yaml"]  # sweeps, not job specs: test_sweep_example
EXAMPLES = sorted(p for p in (REPO / "examples").glob("*.yaml") if p not in SWEEPS)


def nested_models(ann: Any) -> list[tuple[str | None, type[BaseModel]]]:
    """The models a field holds, with their tag: a model, ``Model | None`` (no tag), or a
    discriminated union of tagged models (``train.model``: gpt, llama, hf)."""
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return [(None, ann)]
    if get_origin(ann) is Annotated:
        inner, *meta = get_args(ann)
        tags = [m.tag for m in meta if isinstance(m, Tag)]
        found = nested_models(inner)
        return [(tags[0] if tags else tag, model) for tag, model in found]
    if get_origin(ann) in (Union, UnionType):
        return [pair for arg in get_args(ann) for pair in nested_models(arg)]
    return []


def field_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every field of a model as a dotted path, nested models included (train.optim.lr);
    a family's fields under its tag, as a 422 names them (train.model.llama.n_kv_head)."""
    paths = []
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        paths.append(path)
        for tag, nested in nested_models(info.annotation):
            paths.extend(field_paths(nested, f"{path}.{tag}." if tag else path + "."))
    return paths


def test_there_are_examples() -> None:
    names = {p.name for p in EXAMPLES}
    assert {"tiny-ddp.yaml", "tiny-fsdp.yaml", "gpu-bf16.yaml"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_validates_as_a_job_spec(path: Path) -> None:
    spec = JobSpec.model_validate(yaml.safe_load(path.read_text()))
    assert spec.name and spec.train.steps >= 1


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.name)
def test_sweep_example_validates_as_a_sweep(path: Path) -> None:
    from service.api.sweeps.schemas import SweepIn
    from service.api.sweeps.space import check_space

    sweep = SweepIn.model_validate(yaml.safe_load(path.read_text()))
    base = JobSpec.model_validate(sweep.base).model_dump(mode="json")
    # every path a spec field, every value a valid spec (the model's checks: the service's
    # others need its stores)
    check_space(base, dict(sweep.space), lambda spec, _path: JobSpec.model_validate(spec))
    assert sweep.budget >= sweep.parallelism


def test_the_demo_job_is_a_valid_spec_of_the_tiny_ddp_shape() -> None:
    demo = JobSpec.model_validate(demo_spec(50))
    tiny = JobSpec.model_validate(yaml.safe_load((REPO / "examples/tiny-ddp.yaml").read_text()))
    assert demo.train.steps == 50 and demo.train.strategy == "ddp" and demo.procs_per_node == 2
    assert demo.train.model == tiny.train.model and demo.queue == tiny.queue == "cpu"


def _readme_spec_table() -> dict[str, tuple[str, str]]:
    """README's spec reference: path -> (type and bounds, default), from rows of the form
    ``| `train.optim.lr` | float, > 0, ≤ 10 | `0.0003` | meaning |``."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Job spec reference", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"\|\s*`([a-z0-9_.]+)`\s*\|([^|]*)\|([^|]*)\|", line)
        if m:
            rows[m.group(1)] = (m.group(2).strip(), m.group(3).strip().strip("`"))
    return rows


def _leaf(path: str) -> tuple[Any, Any]:
    """(annotation, FieldInfo) of a dotted path in JobSpec."""
    model: Any = JobSpec
    info: Any = None
    parts = path.split(".")
    i = 0
    while i < len(parts):
        info = model.model_fields[parts[i]]
        model = info.annotation
        i += 1
        nested = nested_models(model)
        if i < len(parts) and nested:
            tagged = dict(nested)
            if parts[i] in tagged:  # a family's tag
                model = tagged[parts[i]]
                i += 1
            else:
                model = nested[0][1]
    return model, info


def _as_yaml(value: Any) -> str:
    return (
        {True: "true", False: "false", None: "null"}.get(value, str(value))
        if (value is None or isinstance(value, bool))
        else str(value)
    )


def test_readme_spec_reference_lists_exactly_the_model_fields() -> None:
    assert JobSpec.model_fields["train"].annotation is TrainConfig  # so train.* is TrainConfig
    documented = set(_readme_spec_table())
    fields = set(field_paths(JobSpec))
    assert fields - documented == set(), "fields missing from README's spec reference"
    assert documented - fields == set(), "README documents fields the spec does not have"


def test_readme_spec_reference_defaults_and_bounds_match_the_models() -> None:
    table = _readme_spec_table()
    for path in field_paths(JobSpec):
        ann, info = _leaf(path)
        kind, default = table[path]
        if nested_models(ann):
            assert kind.startswith("object"), path
            continue
        want = (
            "required"
            if info.is_required()
            else _as_yaml(info.get_default(call_default_factory=True))
        )
        assert default == want, f"{path}: README's default is {default!r}, the model's {want!r}"
        for meta in info.metadata:
            for bound in ("ge", "gt", "le", "lt", "max_length"):
                value = getattr(meta, bound, None)
                if value is not None:
                    assert f"{value:,}".replace(",", "_") in kind or str(value) in kind, (
                        f"{path}: README's {kind!r} lacks the bound {bound} {value}"
                    )


def test_the_shipped_chat_data_is_what_its_script_writes_and_uploads_clean(
    tmp_path: Path,
) -> None:
    """examples/chat/chats.jsonl (README's walkthrough) is make_chats.py's output, each line
    passes the upload's checks, and finetune-chat.yaml trains on it packed."""
    import runpy

    from trainer.sft_lines import check_line

    chats = REPO / "examples" / "chat" / "chats.jsonl"
    script = runpy.run_path(str(REPO / "examples" / "chat" / "make_chats.py"))
    assert chats.read_text(encoding="utf-8") == "\n".join(script["lines"]()) + "\n"
    lines = chats.read_bytes().splitlines()
    assert 200 <= len(lines) <= 1000
    for raw in lines:
        assert check_line("chat", raw) is not None  # LineError on a line the upload would refuse
    weights = [m for line in lines for m in json.loads(line)["messages"] if "weight" in m]
    assert weights and all(m["role"] == "assistant" and m["weight"] == 0 for m in weights)
    spec = JobSpec.model_validate(
        yaml.safe_load((REPO / "examples/finetune-chat.yaml").read_text())
    )
    assert spec.train.data.dataset == "chats" and spec.train.data.packing
    assert spec.train.lora is not None and spec.train.model.family == "hf"
