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
    import yaml

    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, str):
        try:  # YAML 1.1 reads 3e-4 (no dot) as a string; a spec means a number
            return float(value) if value.strip().lower() not in ("nan", "inf", "-inf") else value
        except ValueError:
            return value
    return value


def apply_override(spec: dict[str, Any], assignment: str) -> None:
    """``train.steps=500``: set a value at a dotted path (the value is read as YAML)."""
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
    node[keys[-1]] = _scalar(raw)


def load_spec(path: Path, overrides: list[str]) -> dict[str, Any]:
    """Read a YAML/JSON job spec and apply ``--set`` overrides; SpecError if unreadable."""
    import yaml

    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        spec = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}" if where is not None else ""
        raise SpecError(f"{path} is not valid YAML{at}") from None
    if not isinstance(spec, dict):
        raise SpecError(f"{path} must hold a mapping (name, queue, train, ...)")
    for assignment in overrides:
        apply_override(spec, assignment)
    return spec
