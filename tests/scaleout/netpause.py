"""A TCP relay between pagewire and PostgreSQL that can pause the network of one connection at
the worst moment: after the client's COMMIT of a request's row has reached the server, before the
server's answer reaches the client. The commit lands; its acknowledgement never arrives. This is
a network fault on real sockets in front of a real PostgreSQL, not a stand-in for either."""
from __future__ import annotations

import asyncio
import threading
from typing import Optional

from tests.server.harness import free_port


class PausingRelay:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.armed = threading.Event()  # pause the next connection that commits a request row
        self.paused = threading.Event()  # set once a connection's answers are being held
        self._release: Optional[asyncio.Event] = None
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="netpause", daemon=True)
        self._thread.start()
        self._ready.wait(30)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._release = asyncio.Event()
        server = self._loop.run_until_complete(asyncio.start_server(self._conn, "127.0.0.1", self.port))
        self._ready.set()
        self._loop.run_forever()
        server.close()

    async def _conn(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        sr, sw = await asyncio.open_connection("127.0.0.1", self.target_port)
        hold = asyncio.Event()  # this connection's server → client direction is paused
        seen_insert = False

        async def up() -> None:  # client → server, watching for a request row's COMMIT
            nonlocal seen_insert
            while data := await cr.read(65536):
                if self.armed.is_set():
                    seen_insert = seen_insert or b"INSERT INTO requests" in data
                    if seen_insert and b"COMMIT" in data:
                        self.armed.clear()
                        hold.set()
                        self.paused.set()
                sw.write(data)
                await sw.drain()
            sw.close()

        async def down() -> None:  # server → client, held while paused
            assert self._release is not None
            while data := await sr.read(65536):
                if hold.is_set():
                    await self._release.wait()
                    return  # the answer is lost with the paused connection
                cw.write(data)
                await cw.drain()
            cw.close()

        try:
            await asyncio.gather(up(), down())
        except (ConnectionError, OSError):
            pass
        finally:
            for w in (cw, sw):
                w.close()

    def url(self, db: str) -> str:
        return f"postgresql://pagewire@127.0.0.1:{self.port}/{db}"

    def close(self) -> None:
        async def shutdown() -> None:
            assert self._release is not None
            self._release.set()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._loop.stop()
        asyncio.run_coroutine_threadsafe(shutdown(), self._loop)
        self._thread.join(10)
