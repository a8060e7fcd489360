"""Request priorities, torch-free so the edge and the batch tier can name them.

A request's `priority` orders admission and preemption in the scheduler: lower runs first.
Priorities at or above `BACKGROUND_PRIORITY` are background work (the batch tier's lines,
server.serving.batch): they run only in steps with no interactive work (server.engine.scheduler).
"""
from __future__ import annotations

BACKGROUND_PRIORITY = 1 << 30
