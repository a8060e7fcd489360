"""Multiplex two requests on one WebSocket, cancel one, and resume the other after a reconnect.

Usage:
    make serve            # in another terminal
    .venv/bin/python examples/websocket_client.py
Protocol: docs/websocket.md.
"""
from __future__ import annotations

import asyncio
import json

import websockets

URL = "ws://127.0.0.1:8000/v1/ws"


async def main() -> None:
    last_seq: dict[str, int] = {}
    request_ids: dict[str, str] = {}
    async with websockets.connect(URL) as ws:
        for rid, prompt in (("a", "Once upon a time"), ("b", "The weather today")):
            await ws.send(json.dumps({
                "type": "generate", "id": rid, "kind": "completion", "prompt": prompt,
                "params": {"max_tokens": 64, "temperature": 0}, "detach": True,
            }))
        await ws.send(json.dumps({"type": "cancel", "id": "b"}))
        deltas = 0
        async for raw in ws:
            frame = json.loads(raw)
            if frame["type"] == "accepted":
                request_ids[frame["id"]] = frame["request_id"]
            elif frame["type"] == "delta":
                last_seq[frame["id"]] = frame["seq"]
                deltas += 1
                print(f"{frame['id']}#{frame['seq']}: {frame['text']!r}")
                if frame["id"] == "a" and deltas >= 5:
                    break  # drop the connection mid-stream; "a" was started detached
            elif frame["type"] in ("done", "error"):
                print(frame)
    async with websockets.connect(URL) as ws:
        await ws.send(json.dumps({
            "type": "resume", "request_id": request_ids["a"], "after_seq": last_seq.get("a", 0), "id": "a",
        }))
        async for raw in ws:
            frame = json.loads(raw)
            print(frame.get("type"), frame.get("seq"), repr(frame.get("text", "")))
            if frame["type"] in ("done", "error"):
                break


if __name__ == "__main__":
    asyncio.run(main())
