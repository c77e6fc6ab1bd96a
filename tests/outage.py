"""A TCP relay in front of a server on 127.0.0.1, which a test can take down and bring back: while down, the relay's
port refuses connections and the ones open are cut, as when a server is stopped, while the server behind it keeps its
state (moto's S3 server keeps its objects in memory: a restart would lose them). On another ``host`` address it
also makes the server reachable from network namespaces (``tests.netns.PodNetwork``)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

from pipeline.network import free_ports


class Relay:
    def __init__(self, target_port: int, host: str = "127.0.0.1"):
        self.target_port, self.host = target_port, host
        self.port = free_ports(1)[0]
        self.endpoint = f"http://{host}:{self.port}"
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self.up()

    def up(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.host, self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        """Refuse new connections and cut every open one."""
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        with self._lock:
            for sock in self._open:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            self._open.clear()

    def outage(self, seconds: float) -> None:
        self.down()
        time.sleep(seconds)
        self.up()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open |= {client, server}
            threading.Thread(target=self._pipe, args=(client, server), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            with self._lock:
                self._open -= {source, sink}
