"""The baseline of ``service_get.py``: a bare FastAPI endpoint returning a constant.

Served by the same uvicorn settings as the service (``bench._util.UVICORN_ARGS``); no
middleware, no auth, no database. ``async def`` is FastAPI's cheapest path (no thread hop),
so the ratio against it is the strict one.
"""

from __future__ import annotations

from fastapi import FastAPI

app = FastAPI()


@app.get("/v1/const")
async def const() -> dict[str, str]:
    return {"status": "ok"}
