"""worker.registry's GPU memory: nvidia-smi's answer, read without torch.

nvidia-smi is the outside edge here (a program of the driver, absent on this machine): the
tests put a script of that name first on PATH that prints what the real one prints for
``--query-gpu=index,memory.total --format=csv,noheader,nounits`` (MiB, no units, one line
per GPU), or fails; everything of ours runs as it does on a GPU host.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.registry import gpu_memory_bytes, parse_gpu_memory

MIB = 1 << 20
# An 8-GPU host's answer trimmed to three, with what else the tool may print: a GPU whose
# memory it cannot read, and a warning line.
ANSWER = "0, 81559\n1, [N/A]\n3, 143771\nWARNING: infoROM is corrupted at gpu 0000:41:00.0\n"


def test_parse_reads_index_and_mib_lines() -> None:
    assert parse_gpu_memory(ANSWER) == {0: 81559 * MIB, 3: 143771 * MIB}
    assert parse_gpu_memory("") == {}
    assert parse_gpu_memory("0, 0\n-1, 5\n2, 4.5\n") == {}  # no memory, not integers


def _nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> None:
    tool = tmp_path / "bin" / "nvidia-smi"
    tool.parent.mkdir()
    tool.write_text(f"#!/bin/sh\n{body}\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", str(tool.parent))


def test_each_gpu_of_the_worker_in_its_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _nvidia_smi(tmp_path, monkeypatch, f"printf '{ANSWER}'")
    assert gpu_memory_bytes([3, 0]) == [143771 * MIB, 81559 * MIB]
    assert gpu_memory_bytes([0, 1]) is None  # GPU 1's memory is not known: none is claimed
    assert gpu_memory_bytes(None) is None  # a CPU worker


def test_no_answer_is_unknown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi at all
    assert gpu_memory_bytes([0]) is None
    _nvidia_smi(tmp_path, monkeypatch, "echo 'NVIDIA-SMI has failed' >&2; exit 9")
    assert gpu_memory_bytes([0]) is None
