"""Per-step metrics from rank 0: metrics.jsonl always, Redis events and TensorBoard when available,
and the experiment trackers the spec names (trainer.tracking).

A record is the "metric" event's data (see ``trainer.events``): step, steps, time, loss, lr,
grad_norm, tokens_per_s, tokens_per_s_per_device, step_time_s, tflops, mfu, mem_peak_bytes,
data_wait_frac and, at eval steps, val_loss. NaN and inf travel as null. Publishing runs on the
Publisher's own thread, so a slow or absent Redis never stalls a step.
"""

from __future__ import annotations

import importlib.util
import json
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch

from trainer.config import TrackingConfig
from trainer.env import TrainerEnv
from trainer.events import Publisher, clean_number
from trainer.files import make_dirs, set_mode

__all__ = [
    "MetricsLogger",
    "StepWindow",
    "TensorBoardCurves",
    "format_line",
    "peak_flops",
    "peak_flops_of",
    "peak_memory_bytes",
]

# Dense peak FLOP/s per device from the vendor datasheets: (bf16/fp16 tensor core, fp32).
# fp32 is the non-tensor-core figure: PyTorch leaves TF32 matmuls off by default. Matched
# against torch.cuda.get_device_name() in this order (the first substring that matches wins).
_PEAK_FLOPS: tuple[tuple[str, float, float], ...] = (
    ("H200 NVL", 835.0e12, 60.0e12),  # "NVIDIA H200 NVL" (PCIe form factor)
    ("H200", 989.4e12, 66.9e12),  # SXM ("NVIDIA H200"); GH200's name matches here too
    ("H100 PCIe", 756.0e12, 51.2e12),
    ("H100 NVL", 835.0e12, 60.0e12),
    ("H100", 989.4e12, 66.9e12),  # SXM ("NVIDIA H100 80GB HBM3")
    ("GH200", 989.4e12, 66.9e12),
    ("A100", 312.0e12, 19.5e12),
    ("A800", 312.0e12, 19.5e12),
    ("L40S", 362.05e12, 91.6e12),
    ("L40", 181.0e12, 90.5e12),
    ("L4", 121.0e12, 30.3e12),
    ("A10G", 125.0e12, 31.2e12),  # AWS's A10; NVIDIA's A10 datasheet figures
    ("A10", 125.0e12, 31.2e12),
    ("V100", 125.0e12, 15.7e12),  # fp16 tensor cores (no bf16)
    ("T4", 65.0e12, 8.1e12),
)


def peak_flops(device: torch.device, precision: str) -> float | None:
    """The device's dense peak FLOP/s for this precision; None on CPU or an unknown GPU."""
    if device.type != "cuda":
        return None
    return peak_flops_of(torch.cuda.get_device_name(device), precision)


def peak_flops_of(name: str, precision: str) -> float | None:
    """The dense peak FLOP/s of the device called ``name`` (torch.cuda.get_device_name)."""
    for key, half, fp32 in _PEAK_FLOPS:
        if key in name:
            return fp32 if precision == "fp32" else half
    return None


def peak_memory_bytes(device: torch.device) -> int:
    """Peak CUDA memory allocated by this process, or on CPU its peak resident set."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB


@dataclass
class StepWindow:
    """Training time since the last logged step (eval and checkpoint time left out)."""

    tokens_per_step: int  # global, all ranks
    world: int
    flops_per_token: int
    peak_flops: float | None
    device: torch.device
    steps: int = 0
    seconds: float = 0.0
    data_seconds: float = 0.0

    def add(self, seconds: float) -> None:
        self.steps += 1
        self.seconds += seconds

    def record(self, step: int, steps: int, **values: float | None) -> dict[str, Any]:
        """The metric record for ``step``; starts the next window."""
        tok_s = self.steps * self.tokens_per_step / self.seconds
        tflops = self.flops_per_token * tok_s / self.world / 1e12  # achieved, per device
        record: dict[str, Any] = {
            "step": step,
            "steps": steps,
            "time": time.time(),
            **{k: v for k, v in values.items() if k != "val_loss"},
            "tokens_per_s": tok_s,
            "tokens_per_s_per_device": tok_s / self.world,
            "step_time_s": self.seconds / self.steps,
            "tflops": tflops,
            "mfu": tflops * 1e12 / self.peak_flops if self.peak_flops else None,
            "mem_peak_bytes": peak_memory_bytes(self.device),
            "data_wait_frac": self.data_seconds / self.seconds,
        }
        if values.get("val_loss") is not None:
            record["val_loss"] = values["val_loss"]
        self.steps, self.seconds, self.data_seconds = 0, 0.0, 0.0
        return record


class TensorBoardCurves:
    """One TensorBoard event per logged step carrying all its numbers as scalars.

    Written with tensorboard's own event file writer (a background thread flushes it):
    ``SummaryWriter.add_scalar`` per value cost about 1 ms a step here, 14x this, which is
    a few percent of a small model's step on the training thread.
    """

    def __init__(self, log_dir: Path) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = Event, Summary
        # The folder 0750 here; its event files are 0640 by the trainer's umask.
        self._writer = EventFileWriter(str(make_dirs(log_dir)))

    def add(self, record: dict[str, Any]) -> None:
        values = [
            self._summary.Value(tag=key, simple_value=float(value))
            for key, value in record.items()
            if key not in ("step", "steps", "time") and isinstance(value, int | float)
        ]
        event = self._event(
            wall_time=record.get("time", time.time()),
            step=record["step"],
            summary=self._summary(value=values),
        )
        self._writer.add_event(event)

    def close(self) -> None:
        self._writer.close()


def _clean(record: dict[str, Any]) -> dict[str, Any]:
    return {k: clean_number(v) if isinstance(v, float) else v for k, v in record.items()}


class MetricsLogger:
    """Rank 0's sink for metric records; every other rank gets a logger that drops them."""

    def __init__(
        self,
        run_dir: Path,
        env: TrainerEnv,
        *,
        enabled: bool,
        tracking: TrackingConfig | None = None,
        params: dict[str, Any] | None = None,
    ) -> None:
        self.enabled = enabled
        self._file: TextIO | None = None
        self._publisher: Publisher | None = None
        self._tb: Any = None
        self._tracker: Any = None
        if not enabled:
            return
        self._file = (run_dir / "metrics.jsonl").open("a", encoding="utf-8")
        set_mode(self._file.fileno())
        if env.redis_url:
            self._publisher = Publisher(
                env.redis_url,
                env.job_id or run_dir.name,
                env.attempt,
                "trainer",
                prefix=env.redis_prefix,
            )
        # TensorBoard curves only where the package is installed: it is not a dependency.
        if importlib.util.find_spec("tensorboard") is not None:
            self._tb = TensorBoardCurves(run_dir / "tb")
        if tracking is not None and (tracking.wandb or tracking.mlflow):
            from trainer.tracking import Tracker, flatten

            self._tracker = Tracker(
                tracking,
                flatten(params or {}),
                run_dir,
                job_id=env.job_id or run_dir.name,
                attempt=env.attempt,
                allow_private=env.tracking_allow_private,
            )

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = _clean(record)
        assert self._file is not None
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()
        if self._publisher is not None:
            self._publisher.emit("metric", record)
        if self._tb is not None:
            self._tb.add(record)
        if self._tracker is not None:
            self._tracker.log(record)

    def final_checkpoint(self, path: Path, step: int) -> None:
        """Tell the trackers where the run's last checkpoint is (a tag of the run)."""
        if self._tracker is not None:
            self._tracker.tag({"trainq.checkpoint": str(path), "trainq.checkpoint_step": str(step)})

    def flush(self, timeout: float = 2.0) -> bool:
        """Put every record logged so far on the wire (bounded; at once while Redis is down).

        Called before a checkpoint: a run killed after it keeps every step's metric up to the
        checkpointed step, so the attempt that resumes from it leaves no gap behind.
        """
        if self._publisher is None:
            return True
        if self._publisher.link_down:  # an outage must not stall training; all is kept
            return False
        return self._publisher.flush(timeout)

    def close(self, timeout: float = 2.0) -> None:
        """Flush Redis within ``timeout`` (bounded: an unreachable Redis costs at most that),
        the trackers within their own bound (trainer.tracking)."""
        if self._publisher is not None:
            self._publisher.close(timeout)
        if self._tracker is not None:
            self._tracker.close()
        if self._tb is not None:
            self._tb.close()
        if self._file is not None:
            self._file.close()


def format_line(record: dict[str, Any]) -> str:
    """One human line per logged step for the run's stdout."""
    parts = [f"step {record['step']}/{record['steps']}", f"loss {record['loss']:.4f}"]
    if record.get("val_loss") is not None:
        parts.append(f"val_loss {record['val_loss']:.4f}")
    parts += [
        f"lr {record['lr']:.3e}",
        f"grad_norm {record['grad_norm']:.3f}" if record["grad_norm"] is not None else "",
        f"tok/s {record['tokens_per_s']:.0f}",
        f"step {record['step_time_s'] * 1000:.1f}ms",
    ]
    if record.get("mfu") is not None:
        parts.append(f"mfu {record['mfu'] * 100:.1f}%")
    return "  ".join(p for p in parts if p)
