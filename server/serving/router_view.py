"""What a router needs from a replica, in one place: queue depth, running sequences, free KV
blocks and prefix-cache hit rate, read from the engine's stats snapshot and the admission queue.

pagewire stays a plain replica (no router or membership of its own): an existing proxy routes by
consistent hash on the conversation key and health-checks `/health` (docs/scale-out.md). This
view is what that proxy, or an operator, reads to weigh or watch replicas: `/health` carries it
under `load`; `/metrics` has each as a gauge (`router_gauges` adds the two it lacked).
"""
from __future__ import annotations

from typing import Any, Optional


def router_view(stats: Any, admission_depth: int, draining: bool, instance: Optional[str]) -> dict[str, Any]:
    """`stats` is the engine's EngineStats snapshot (None while the model loads)."""
    hits = int(getattr(stats, "prefix_hit_tokens", 0) or 0)
    misses = int(getattr(stats, "prefix_miss_tokens", 0) or 0)
    return {
        "queue_depth": admission_depth + int(getattr(stats, "num_waiting", 0) or 0),
        "running_sequences": int(getattr(stats, "num_running", 0) or 0),
        "free_kv_blocks": int(getattr(stats, "free_blocks", 0) or 0),
        "kv_usage": float(getattr(stats, "kv_usage", 0.0) or 0.0),
        "prefix_cache_hit_rate": hits / (hits + misses) if hits + misses else 0.0,
        "draining": draining,
        "instance": instance,
    }


def router_gauges(stats: Any) -> dict[str, tuple[str, float]]:
    """The two figures /metrics did not already have as gauges (it has running, waiting, the
    admission queue's depth and KV usage)."""
    v = router_view(stats, 0, False, None)
    return {
        "pagewire_kv_free_blocks": ("KV cache blocks the allocator has free.",
                                    float(v["free_kv_blocks"])),
        "pagewire_prefix_cache_hit_rate": ("Prompt tokens served from the prefix cache / all prompt tokens, "
                                           "since start.", float(v["prefix_cache_hit_rate"])),
    }
