"""A job spec file as the CLI reads it: YAML or JSON, plus ``--set key.path=value`` overrides.

Only parsing happens here; validation is the API's (a 422 names the field), so the CLI and
curl get the same answer for the same spec.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["SpecError", "apply_override", "load_spec"]


class SpecError(ValueError):
    """A spec file or ``--set`` that cannot be used; exit code 2 (usage)."""


def _scalar(text: str) -> Any:
    """A ``--set`` value, read as the spec file's YAML is (3e-4 a float, 1:20 a string)."""
    from trainer.yamlspec import SpecSyntaxError, load_yaml

    try:
        return load_yaml(text)
    except SpecSyntaxError:
        return text


def apply_override(spec: dict[str, Any], assignment: str) -> None:
    """``train.steps=500``: set a value at a dotted path (the value is read as YAML).

    A key that names one of several alternatives (``trainer.config.REPLACES``: a dataset
    instead of a data path, say) drops the others, which the API would refuse beside it."""
    from trainer.config import drop_replaced

    path, sep, raw = assignment.partition("=")
    keys = [k.strip() for k in path.split(".")]
    if not sep or not all(keys):
        raise SpecError(f"--set {assignment!r} is not KEY.PATH=VALUE (e.g. train.steps=500)")
    node: Any = spec
    for i, key in enumerate(keys[:-1]):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            where = ".".join(keys[: i + 1])
            raise SpecError(f"--set {assignment!r}: {where} is not a mapping in the spec")
        node = child
    value = _scalar(raw)
    node[keys[-1]] = value
    if value is not None:
        drop_replaced(spec, ".".join(keys))


def load_spec(path: Path, overrides: list[str]) -> dict[str, Any]:
    """Read a YAML/JSON job spec and apply ``--set`` overrides; SpecError if unreadable.

    The same strict YAML as the API reads (``trainer.yamlspec``): a duplicate key or an
    alias is refused here, with its line, before anything is sent."""
    from trainer.yamlspec import SpecSyntaxError, load_yaml

    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise SpecError(f"{path} is not UTF-8 (byte offset {exc.start})") from None
    try:
        spec = load_yaml(text)
    except SpecSyntaxError as exc:
        first = str(exc).splitlines()[0] if str(exc) else "unreadable"
        raise SpecError(f"{path} is not a valid YAML spec: {first}") from None
    if not isinstance(spec, dict):
        raise SpecError(f"{path} must hold a mapping (name, queue, train, ...)")
    for assignment in overrides:
        apply_override(spec, assignment)
    return spec
