"""``trainq generate ID "prompt"``: text from a job's checkpoint, through ``POST
/v1/completions`` (the generation runs on a worker serving the job's queue).

Imports only typer at module level (httpx when the command runs), like the other client
commands. The generated text is the model's own output and is printed as it is; every
error is one line on stderr with the client's exit codes (6 for a refused request: 404,
409, 422; 5 for 503/504).
"""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

import typer

from service.cli.base import cli_errors, make_client

__all__ = ["register"]


def register(app: typer.Typer) -> None:
    @app.command("generate")
    @cli_errors
    def generate(
        job_id: Annotated[str, typer.Argument(metavar="ID", help="job id (or ID:STEP)")],
        prompt: Annotated[str, typer.Argument(help="the text to continue")],
        max_tokens: Annotated[int, typer.Option("--max-tokens", min=1, max=4096)] = 64,
        temperature: Annotated[
            float, typer.Option("--temperature", min=0.0, max=2.0, help="0: greedy")
        ] = 1.0,
        top_k: Annotated[int, typer.Option("--top-k", min=0, help="0: off")] = 0,
        top_p: Annotated[float, typer.Option("--top-p", min=0.0, max=1.0)] = 1.0,
        seed: Annotated[int | None, typer.Option("--seed", min=0, help="repeatable")] = None,
        stop: Annotated[list[str] | None, typer.Option("--stop", help="stop before it")] = None,
        stream: Annotated[bool, typer.Option("--stream", help="print tokens as they come")] = False,
        as_json: Annotated[bool, typer.Option("--json", help="the API's answer as JSON")] = False,
    ) -> None:
        """Generate text from a job's newest checkpoint (or ID:STEP) on a worker."""
        body: dict[str, Any] = {
            "model": job_id,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_k": top_k,
            "top_p": top_p,
        }
        if seed is not None:
            body["seed"] = seed
        if stop:
            body["stop"] = stop
        with make_client() as client:
            if stream and not as_json:
                for text in client.stream_completion(body):
                    sys.stdout.write(text)
                    sys.stdout.flush()
                sys.stdout.write("\n")
                return
            out = client.complete(body)
        if as_json:
            typer.echo(json.dumps(out, indent=2))
        else:
            typer.echo(out["choices"][0]["text"])
