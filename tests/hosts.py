"""Hosts for tests and benchmarks: Linux network namespaces on one bridge, as separate hosts.

``Hosts(n)`` makes a bridge in the root namespace with a ``10.231.X.0/24`` subnet that no
interface holds yet (the root side is ``.1``), and ``n`` namespaces, each joined to the
bridge by a veth pair and holding one address (``.11``, ``.12`` ...) on its own ``eth0``.
Processes started with ``Host.popen`` run inside their namespace (``ip netns exec``): they
reach the root namespace, and each other, only over the bridge, never over a shared
loopback. The file system is not namespaced, so one folder is every host's "NFS" data and
runs roots.

Redis listens on 127.0.0.1 of the root namespace only, so each host gets a ``Forwarder``:
a small TCP relay in this process from ``.1:PORT`` on the bridge to Redis. One relay per
host lets a test cut one host off Redis alone (``Forwarder.cut``), while the others go on.

Faults: ``Host.kill_all`` (every process of the namespace, SIGKILL), ``Host.link(False)``
(the root side of its veth down: the host is cut off, its processes keep running);
``Forwarder.reset`` ends the relayed connections once a link is back, so a host learns of the
outage at once rather than at TCP's next retransmission.

Everything made is undone by ``close`` (namespaces, links, processes, relays), which the
fixtures call from a finalizer, so a failing test leaves nothing behind. ``available()``
says why namespaces cannot be made here (not root, no ``ip``), for a clear skip.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import re
import selectors
import shutil
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Forwarder", "Host", "Hosts", "available"]

IP = shutil.which("ip") or "/usr/sbin/ip"
_LOCK = "/tmp/trainq-hosts.lock"
_CMD_TIMEOUT_S = 20.0


def _ip(*args: str, netns: str | None = None, check: bool = True) -> str:
    argv = [IP, *(["netns", "exec", netns, IP] if netns else []), *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=_CMD_TIMEOUT_S, check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")
    return done.stdout


def available() -> str | None:
    """None if network namespaces can be made here, else why not (a skip reason)."""
    if os.geteuid() != 0:
        return "network namespaces need root (the hosts harness makes veth pairs and a bridge)"
    if not Path(IP).exists():
        return "the ip tool (iproute2) is not installed"
    probe = f"tqprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        return f"cannot create a network namespace here: {exc}"
    _ip("netns", "del", probe, check=False)
    return None


class Forwarder:
    """A TCP relay from ``listen`` to ``target``, in threads of this process.

    ``cut()`` closes the listening socket and every relayed connection: the host behind it
    finds Redis unreachable (connections refused) until ``resume()``.
    """

    def __init__(self, listen: tuple[str, int], target: tuple[str, int]) -> None:
        self.listen, self.target = listen, target
        self._server: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._lose = 0  # replies still to lose (``lose_replies``)

    @property
    def port(self) -> int:
        return self.listen[1]

    def start(self) -> Forwarder:
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(self.listen)
        server.listen(128)
        self.listen = server.getsockname()
        self._server = server
        self._closed.clear()
        threading.Thread(target=self._accept, args=(server,), daemon=True).start()
        return self

    def _accept(self, server: socket.socket) -> None:
        while not self._closed.is_set():
            try:
                client, _ = server.accept()
            except OSError:
                return  # closed by cut() or close()
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._conns.update((client, upstream))
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        sel = selectors.DefaultSelector()
        peers = {a: b, b: a}
        try:
            for s in peers:
                s.setblocking(True)
                sel.register(s, selectors.EVENT_READ)
            while not self._closed.is_set():
                for key, _ in sel.select(1.0):
                    src = key.fileobj
                    assert isinstance(src, socket.socket)
                    data = src.recv(65536)
                    if not data:
                        return
                    if src is b and self._take_loss():
                        return  # the target answered; the client never hears it
                    peers[src].sendall(data)
        except (OSError, ValueError):
            return
        finally:
            sel.close()
            with self._lock:
                for s in peers:
                    self._conns.discard(s)
            for s in peers:
                with contextlib.suppress(OSError):
                    s.close()

    def lose_replies(self, n: int = 1) -> None:
        """The next ``n`` answers from the target are dropped, each with its connection: the
        command ran there, and the client sees its connection end before the reply."""
        with self._lock:
            self._lose = n

    def _take_loss(self) -> bool:
        with self._lock:
            if self._lose <= 0:
                return False
            self._lose -= 1
            return True

    def cut(self) -> None:
        self._closed.set()
        if self._server is not None:
            with contextlib.suppress(OSError):
                self._server.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept (Linux)
            self._server.close()
            self._server = None
        self.reset()

    def resume(self) -> None:
        if self._server is None:
            self.start()

    def reset(self) -> None:
        """End every relayed connection now, and go on listening. After a link comes back,
        a peer that sent nothing while it was down (a client blocked in a read) would learn
        of the outage only by TCP's next retransmission, up to the outage's length later;
        reset, each side sees its connection end at once and connects again."""
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()

    close = cut


@dataclass(eq=False)  # compared by identity: one object per namespace
class Host:
    """One namespace: its name, address, and the root side of its veth pair."""

    netns: str
    address: str
    veth: str  # the root namespace's end
    relay: Forwarder | None = None
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def popen(
        self, argv: list[str], env: dict[str, str], log: Path, cwd: Path | None = None
    ) -> subprocess.Popen[bytes]:
        """``argv`` inside this host's namespace, in a session of its own, output to ``log``."""
        with log.open("ab") as out:
            proc = subprocess.Popen(
                [IP, "netns", "exec", self.netns, *argv],
                env=env,
                cwd=cwd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc

    def pids(self) -> list[int]:
        out = _ip("netns", "pids", self.netns, check=False)
        return [int(p) for p in out.split() if p.isdigit()]

    def kill_all(self) -> int:
        """SIGKILL every process in the namespace (a host lost); how many there were."""
        killed = 0
        for _ in range(20):  # bounded: a fork between listing and killing is caught next round
            pids = self.pids()
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
            time.sleep(0.05)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
        return killed

    def link(self, up: bool) -> None:
        _ip("link", "set", self.veth, "up" if up else "down")


class Hosts:
    """``count`` namespace hosts on a fresh bridge; ``close()`` removes all of it."""

    def __init__(self, count: int, redis: tuple[str, int] = ("127.0.0.1", 6379)) -> None:
        self.redis = redis
        self.hosts: list[Host] = []
        self._made_bridge = False
        # Sessions side by side (pytest-xdist's workers, a bench) each make a bridge: the
        # subnet is one no interface holds yet, chosen and taken under a lock of the machine.
        with open(_LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            held = set(re.findall(r"inet 10\.231\.(\d+)\.", _ip("-o", "-4", "addr", "show")))
            free = [n for n in range(1, 255) if str(n) not in held]
            if not free:
                raise RuntimeError("every 10.231.X.0/24 subnet is taken by another bridge")
            self.net = random.choice(free)
            tag = f"tq{self.net}x{os.getpid() % 10000}"  # <= 15 chars with a suffix of 2
            self.bridge = f"{tag}br"
            self.gateway = f"10.231.{self.net}.1"
            try:
                _ip("link", "add", self.bridge, "type", "bridge")
                self._made_bridge = True
                _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            except BaseException:
                self.close()
                raise
        try:
            _ip("link", "set", self.bridge, "up")
            for i in range(count):
                self.hosts.append(self._add(tag, i))
        except BaseException:
            self.close()
            raise

    def _add(self, tag: str, i: int) -> Host:
        netns, veth = f"{tag}h{i}", f"{tag}v{i}"
        _ip("netns", "add", netns)
        host = Host(netns, f"10.231.{self.net}.{11 + i}", veth)
        self.hosts.append(host)  # closed with the rest if a later step fails
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns)
        _ip("link", "set", veth, "master", self.bridge)
        _ip("link", "set", veth, "up")
        _ip("addr", "add", f"{host.address}/24", "dev", "eth0", netns=netns)
        _ip("link", "set", "eth0", "up", netns=netns)
        _ip("link", "set", "lo", "up", netns=netns)
        _ip("route", "add", "default", "via", self.gateway, netns=netns)
        host.relay = Forwarder((self.gateway, 0), self.redis).start()
        self.hosts.remove(host)
        return host

    def redis_url(self, host: Host, db: int) -> str:
        """The Redis URL ``host`` uses: its own relay on the bridge."""
        assert host.relay is not None
        return f"redis://{self.gateway}:{host.relay.port}/{db}"

    def close(self) -> None:
        for host in self.hosts:
            with contextlib.suppress(Exception):
                host.kill_all()
            if host.relay is not None:
                host.relay.close()
            _ip("link", "del", host.veth, check=False)
            _ip("netns", "del", host.netns, check=False)
        self.hosts.clear()
        if self._made_bridge:
            _ip("link", "del", self.bridge, check=False)
            self._made_bridge = False

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
