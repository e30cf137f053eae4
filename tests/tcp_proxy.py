"""A TCP proxy a test controls: it forwards, or it black-holes.

``TcpProxy(target_port)`` listens on a free port of 127.0.0.1 and forwards each connection to the
target. :meth:`black_hole` stops forwarding, both ways, for the connections open and for new ones
(accepted, then held): the proxy's kernel still acknowledges whatever the client sends, so no TCP
timeout of the client ever fires — what a hung server, a stuck middlebox or a partition behind a
proxy looks like from the client. :meth:`forward` lets the traffic through again (held connections
are then connected to the target).
"""

from __future__ import annotations

import select
import socket
import threading

from service.scheduler.local_head import free_port


class TcpProxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1"):
        self.target = (target_host, target_port)
        self.port = free_port()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._open = threading.Event()  # set: forwarding
        self._open.set()
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="tcp-proxy-accept", daemon=True).start()

    def black_hole(self) -> None:
        self._open.clear()

    def forward(self) -> None:
        self._open.set()

    def close(self) -> None:
        self._closed.set()
        self._open.set()
        self._listener.close()
        with self._lock:
            for s in self._sockets:
                try:
                    s.close()
                except OSError:
                    pass

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        with self._lock:
            self._sockets.append(client)
        while not self._open.wait(0.1):  # a connection made while black-holed waits, unanswered
            if self._closed.is_set():
                return
        try:
            upstream = socket.create_connection(self.target, timeout=5)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        with self._lock:
            self._sockets.append(upstream)
        self._pump(client, upstream)

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        peers = {a: b, b: a}
        try:
            while not self._closed.is_set():
                if not self._open.is_set():  # black-holed: read nothing, forward nothing
                    self._open.wait(0.1)
                    continue
                readable, _, _ = select.select(list(peers), [], [], 0.1)
                for s in readable:
                    data = s.recv(65536)
                    if not data:
                        return
                    peers[s].sendall(data)
        except OSError:
            return
        finally:
            for s in (a, b):
                try:
                    s.close()
                except OSError:
                    pass
