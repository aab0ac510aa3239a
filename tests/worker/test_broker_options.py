"""The worker's broker connections find a dead peer in bounded time (worker.celery_app).

kombu's Redis transport sets no socket timeout and no TCP keepalive by default: a command on
a connection whose peer vanished silently (a host cut off) blocks the consumer's event loop
until TCP gives up. The connections the worker's app opens carry the bounds: checked on
the sockets themselves, as the kernel sees them.
"""

from __future__ import annotations

import socket

from worker.celery_app import app


def test_broker_sockets_have_keepalive_and_timeouts(broker_url: str) -> None:
    with app.connection_for_read(broker_url) as conn:
        pool = conn.default_channel.client.connection_pool
        c = pool.get_connection()
        try:
            c.connect()
            sock = c._sock
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            if hasattr(socket, "TCP_KEEPIDLE"):  # Linux
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 10
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 5
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 3
            assert sock.gettimeout() == 10  # socket_timeout
        finally:
            pool.release(c)
        assert conn.default_channel.health_check_interval == 10
