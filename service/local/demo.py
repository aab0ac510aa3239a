"""The demo job of ``trainq up --demo``: a tiny DDP run on the bundled corpus, followed live."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from service.cli.client import Client

__all__ = ["DEMO_STEPS", "demo_spec", "run_demo"]

DEMO_STEPS = 200


def demo_spec(steps: int = DEMO_STEPS) -> dict[str, Any]:
    """The demo job: examples/tiny-ddp.yaml's shape, 2 CPU ranks on the bundled corpus."""
    return {
        "name": "demo",
        "labels": {"purpose": "demo"},
        "queue": "cpu",
        "nodes": 1,
        "procs_per_node": 2,
        "max_runtime_s": 1800,
        "retries": 1,
        "train": {
            "strategy": "ddp",
            "precision": "fp32",
            "steps": steps,
            "seed": 42,
            "model": {"n_layer": 2, "n_head": 2, "d_model": 64, "seq_len": 64, "vocab_size": 256},
            "data": {"path": "demo"},
            "batch": {"micro_batch_size": 8, "grad_accum_steps": 1},
            "optim": {"lr": 3.0e-3, "weight_decay": 0.1, "warmup_steps": 10, "grad_clip": 1.0},
            "eval": {"every": 50, "steps": 5},
            "checkpoint": {"every": 100, "keep": 2},
            "log_every": 1,
        },
    }


def run_demo(client: Client, url: str, steps: int, out: TextIO) -> None:
    """Submit the demo job and print its progress until it ends."""
    from service.cli.client import ClientError
    from service.cli.output import Progress, outcome_line, trainq_command

    def say(text: str) -> None:
        out.write(text + "\n")
        out.flush()

    job = client.submit(demo_spec(steps))
    job_id = job["id"]
    say(f"demo: job {job_id} submitted ({steps} steps, 2 DDP ranks on CPU)")
    say(f"  follow it elsewhere: TRAINQ_URL={url} {trainq_command()} logs {job_id} -f")
    say(f"                       curl -N {url}/v1/jobs/{job_id}/events")
    progress = Progress(out)
    try:
        for ev in client.follow_events(job_id):
            progress.event(ev.event, ev.data)
    except ClientError as exc:
        progress.close()
        say(f"demo: stopped following: {exc.message}")
        return
    progress.close()
    final = client.job(job_id)
    say(f"demo: {outcome_line(final)}")
