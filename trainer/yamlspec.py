"""YAML for specs: strict, bounded, and fast. One loader for every place a spec is read
(the API's YAML bodies, ``trainq submit``'s spec files, the trainer's ``--config``).

A spec is a contract a CI pipeline relies on, so the loader reads YAML as YAML 1.2's core
schema reads it, not as PyYAML's YAML 1.1 default:

- ``1:20`` is the string "1:20", not 80 (1.1's base-60 integers); ``yes``/``on`` are
  strings, not booleans; ``1e-3`` is a float (1.1 needs a dot);
- a key given twice is an error, not "the last one wins";
- aliases (``*name``) are refused: a spec has no use for them, and they are how a small
  document expands to a huge one ("billion laughs");
- nesting deeper than ``MAX_DEPTH`` is refused before anything is built, so no input can
  exhaust the interpreter's recursion.

libyaml's C parser is used when PyYAML has it (it is about 10x faster than the pure
Python one); the result is the same either way. Imports only yaml: the API process and the
client commands load it without torch.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

__all__ = ["MAX_DEPTH", "SpecSyntaxError", "json_depth_ok", "load_yaml"]

MAX_DEPTH = 64

try:
    from yaml import CSafeLoader as _Base
except ImportError:  # PyYAML built without libyaml
    from yaml import SafeLoader as _Base  # type: ignore[assignment]


class SpecSyntaxError(ValueError):
    """The text is not a spec this loader accepts; the message says where and why."""


class _StrictLoader(_Base):
    """SafeLoader with YAML 1.2 core scalars and duplicate keys refused."""

    def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
        mapping = dict(super().construct_mapping(node, deep=deep))
        if len(mapping) < len(node.value):  # some key came twice: say which, and where
            seen: set[tuple[str, Any]] = set()
            for key_node, _ in node.value:
                key = (key_node.tag, key_node.value if key_node.id == "scalar" else id(key_node))
                if key in seen:
                    line = key_node.start_mark.line + 1
                    raise SpecSyntaxError(f"line {line}: key {key[1]!r} is given twice")
                seen.add(key)
            line = node.start_mark.line + 1  # two spellings of one key, e.g. 1 and 0x1
            raise SpecSyntaxError(f"line {line}: a key of this mapping is given twice")
        return mapping


# YAML 1.2 core schema: replace 1.1's implicit resolvers for bool, int and float (and drop
# its timestamps and merge keys), keep null and str.
_StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag.endswith((":null", ":str"))]
    for first, resolvers in _Base.yaml_implicit_resolvers.items()
}
for _tag, _regexp, _first in (
    ("tag:yaml.org,2002:bool", r"^(?:true|True|TRUE|false|False|FALSE)$", "tTfF"),
    ("tag:yaml.org,2002:int", r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$", "-+0123456789"),
    (
        "tag:yaml.org,2002:float",
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$",
        "-+0123456789.",
    ),
):
    _StrictLoader.add_implicit_resolver(_tag, re.compile(_regexp), list(_first))


def _int(loader: Any, node: Any) -> int:
    text = loader.construct_scalar(node)
    if text.startswith("0o"):
        return int(text[2:], 8)
    return int(text, 0) if text.startswith("0x") else int(text, 10)


def _float(loader: Any, node: Any) -> float:
    text = str(loader.construct_scalar(node)).lower()
    if text.endswith((".inf", ".nan")):
        return float(text.replace(".", ""))
    return float(text)


_StrictLoader.add_constructor("tag:yaml.org,2002:int", _int)
_StrictLoader.add_constructor("tag:yaml.org,2002:float", _float)


def _check_events(text: str) -> None:
    """Aliases and depth, from the parser's events, before any object is built."""
    depth = 0
    for event in yaml.parse(text, Loader=_Base):
        if isinstance(event, yaml.AliasEvent):
            line = event.start_mark.line + 1 if event.start_mark else "?"
            raise SpecSyntaxError(f"line {line}: YAML aliases (*name) are not allowed in a spec")
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_DEPTH:
                raise SpecSyntaxError(f"nested deeper than {MAX_DEPTH} levels")
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1


def load_yaml(text: str) -> Any:
    """One YAML document, strictly; SpecSyntaxError (a ValueError) says what is wrong."""
    try:
        _check_events(text)
        return yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as exc:
        raise SpecSyntaxError(str(exc)) from exc


_JSON_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")


def json_depth_ok(raw: bytes, limit: int = MAX_DEPTH) -> bool:
    """Whether JSON text nests no deeper than ``limit`` (strings skipped), checked without
    parsing, so a body nested thousands deep never reaches a recursive parser."""
    brackets = _JSON_STRINGS.sub(b"", raw).translate(None, _NOT_BRACKETS)
    if brackets.count(b"[") + brackets.count(b"{") <= limit:
        return True
    depth = 0
    for c in brackets:
        if c in b"[{":
            depth += 1
            if depth > limit:
                return False
        else:
            depth -= 1
    return True
