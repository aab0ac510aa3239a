"""``trainq plan``'s text: the dry run's parameters, tokens, memory per device by term, the
data-parallel layout, fits.

Only typer-free formatting over the API's JSON (``PlanOut``); every server string goes
through ``clean`` (``table`` cleans its cells)."""

from __future__ import annotations

from typing import Any

from service.cli.output import clean, table

__all__ = ["plan_text"]

TERMS = ["weights", "gathered", "gradients", "optimizer", "activations", "optimizer_step", "total"]


def _size(value: Any) -> str:
    if not isinstance(value, int | float):
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:,.0f} {unit}" if unit == "B" else f"{value:,.1f} {unit}"
        value /= 1024
    return f"{value:,.1f} TiB"


def _count(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) else "unknown"


def plan_text(out: dict[str, Any]) -> str:
    """``trainq plan``: parameters, tokens, the memory per device by term, fits."""
    params = out.get("parameters") or {}
    head = [
        f"model:     {out.get('family')}, {_count(params.get('total'))} parameters"
        f" ({_count(params.get('trainable'))} trainable"
        + (
            f", {_count(params.get('active'))} active per token)"
            if params.get("active") != params.get("total")
            else ")"
        ),
        f"per step:  {_count(out.get('tokens_per_step'))} tokens"
        f" on {out.get('world_size')} rank(s)",
    ]
    lines = [clean(line) for line in head]
    memory = out.get("memory")
    if isinstance(memory, dict):
        device, host = memory.get("device") or {}, memory.get("host") or {}
        offload = bool(host.get("total"))
        rows = [
            [term, _size(device.get(term)), *([_size(host.get(term))] if offload else [])]
            for term in TERMS
        ]
        header = ["MEMORY", "PER DEVICE", *(["HOST (OFFLOADED)"] if offload else [])]
        if offload:
            rows.append(["per node", "", _size(memory.get("host_per_node"))])
        lines += ["", table(rows, header), ""]  # table cleans every cell
    verdict = out.get("fits")
    fits = "yes" if verdict is True else "NO" if verdict is False else "unknown"
    mesh = out.get("layout")
    tail = [f"layout:    {mesh.get('describe')}"] if isinstance(mesh, dict) else []
    tail += [f"fits:      {fits}: {out.get('fits_reason')}"]
    tail += [f"note:      {note}" for note in out.get("notes") or []]
    return "\n".join([*lines, *(clean(line) for line in tail)])
