"""A TCP proxy between the browser and a pagewire server that a test can hold and cut.

This is how the UI tests drop the network under a live page without touching the page's code:
the browser talks to the proxy's port, the proxy relays bytes to the server. For WebSocket
connections it parses the server→browser frames, so a test can say "let N more frames through,
then hold the rest" (the page then shows a known part of an answer while the server keeps
generating), and `cut()` resets every connection at once, dropping what was held, exactly like
a network that went away mid-answer.
"""
from __future__ import annotations

import select
import socket
import struct
import threading
from typing import Optional

from tests.server.harness import free_port


def _reset(sock: socket.socket) -> None:
    """Drop a connection the way a network failure does: no WebSocket close frame, and RST
    (SO_LINGER 0) for anything unsent. shutdown() first, because close() alone would wait for
    the pump thread blocked on this socket."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


class _Link:
    """One browser connection and its upstream twin."""

    def __init__(self, proxy: "CuttableProxy", client: socket.socket, upstream: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.upstream = upstream
        self.closed = False
        self.is_ws = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            _reset(self.client)
            _reset(self.upstream)
            if self.is_ws:
                self.proxy.release()  # what was held died with this connection; the next one flows

    def pump_up(self) -> None:
        """Browser → server, verbatim; notes whether this is a WebSocket upgrade."""
        try:
            while True:
                data = self.client.recv(65536)
                if not data:
                    break
                if b"upgrade: websocket" in data.lower():
                    self.is_ws = True
                self.upstream.sendall(data)
        except OSError:
            pass
        self.close()

    def pump_down(self) -> None:
        """Server → browser. WebSocket traffic goes frame by frame so it can be held between frames.
        The short select timeout lets frames held in `buf` flow after `release()` even when the
        server has nothing more to send."""
        buf = b""
        headers_done = False
        try:
            while not self.closed:
                if select.select([self.upstream], [], [], 0.05)[0]:
                    data = self.upstream.recv(65536)
                    if not data:
                        break
                    if not self.is_ws:
                        self.client.sendall(data)
                        continue
                    buf += data
                if not headers_done:
                    end = buf.find(b"\r\n\r\n")
                    if end < 0:
                        continue
                    self.client.sendall(buf[:end + 4])
                    buf = buf[end + 4:]
                    headers_done = True
                while True:
                    n = _frame_length(buf)
                    if n is None or not self.proxy._may_forward(buf[0]):
                        break
                    self.client.sendall(buf[:n])
                    buf = buf[n:]
        except (OSError, ValueError):
            pass
        self.close()


def _frame_length(buf: bytes) -> Optional[int]:
    """Bytes in the first complete WebSocket frame of `buf` (RFC 6455 §5.2), or None if incomplete."""
    if len(buf) < 2:
        return None
    n = buf[1] & 0x7F
    head = 2
    if n == 126:
        if len(buf) < 4:
            return None
        n, head = struct.unpack(">H", buf[2:4])[0], 4
    elif n == 127:
        if len(buf) < 10:
            return None
        n, head = struct.unpack(">Q", buf[2:10])[0], 10
    if buf[1] & 0x80:
        head += 4  # masked (client frames only; kept for completeness)
    return head + n if len(buf) >= head + n else None


class CuttableProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = free_port()
        self._lock = threading.Condition()
        self._links: list[_Link] = []
        self._budget: Optional[int] = None  # data frames still allowed through; None = no hold
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", self.port))
        self._sock.listen(64)
        self._stopped = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._stopped:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
                upstream.settimeout(None)
            except OSError:  # server down (e.g. restarting): the browser sees a failed connection
                _reset(client)
                continue
            link = _Link(self, client, upstream)
            with self._lock:
                self._links.append(link)
            threading.Thread(target=link.pump_up, daemon=True).start()
            threading.Thread(target=link.pump_down, daemon=True).start()

    def _may_forward(self, first_byte: int) -> bool:
        with self._lock:
            if self._budget is None:
                return True
            if self._budget <= 0:
                return False
            if first_byte & 0x0F < 8:  # data frame (text, binary, continuation); control frames are free
                self._budget -= 1
            return True

    def hold_after(self, frames: int) -> None:
        """Let `frames` more WebSocket data frames reach the browser, then hold the rest."""
        with self._lock:
            self._budget = frames

    def release(self) -> None:
        """Stop holding; held frames flow on the connection's next read."""
        with self._lock:
            self._budget = None

    def cut(self) -> None:
        """Reset every connection now, dropping anything held; new connections flow freely."""
        with self._lock:
            links, self._links = self._links, []
            self._budget = None
        for link in links:
            link.close()

    def close(self) -> None:
        self._stopped = True
        _reset(self._sock)
        self.cut()
