"""Per-model metrics, read from the model pool's lanes at scrape time (labels: `model`).

Counters live on the lanes (server.serving.model_lane), which outlive loads and unloads, so a
model's counts do not reset when its engine goes: requests ended by state, prompt and
completion tokens, loads and their total seconds, unloads. Gauges: loaded (1/0), live requests,
footprint in the budget, the latest load's seconds; and the budget itself and what is in use.
"""
from __future__ import annotations

from typing import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from server.serving.model_lane import LaneState
from server.serving.model_pool import ModelPool


class ModelCollector(Collector):
    def __init__(self, pool: ModelPool) -> None:
        self.pool = pool

    def collect(self) -> Iterable[Metric]:
        lanes = list(self.pool.lanes.values())
        loaded = GaugeMetricFamily("pagewire_model_loaded", "1 while the model is loaded.", labels=["model"])
        live = GaugeMetricFamily("pagewire_model_live_requests", "Requests for the model that have not ended.",
                                 labels=["model"])
        footprint = GaugeMetricFamily("pagewire_model_footprint_bytes",
                                      "The model's weights, activations and KV pool in the memory budget.",
                                      labels=["model"])
        last = GaugeMetricFamily("pagewire_model_load_seconds", "Seconds the model's latest load took.",
                                 labels=["model"])
        loads = CounterMetricFamily("pagewire_model_loads", "Loads of the model.", labels=["model"])
        load_s = CounterMetricFamily("pagewire_model_load_seconds_total", "Seconds spent loading the model.",
                                     labels=["model"])
        unloads = CounterMetricFamily("pagewire_model_unloads", "Unloads of the model (budget or keep_alive).",
                                      labels=["model"])
        requests = CounterMetricFamily("pagewire_model_requests", "Requests ended, by model and final ledger state.",
                                       labels=["model", "state"])
        prompt = CounterMetricFamily("pagewire_model_prompt_tokens", "Prompt tokens of ended requests, by model.",
                                     labels=["model"])
        completion = CounterMetricFamily("pagewire_model_completion_tokens",
                                         "Completion tokens of ended requests, by model.", labels=["model"])
        for lane in lanes:
            m = [lane.name]
            loaded.add_metric(m, 1.0 if lane.state is LaneState.LOADED else 0.0)
            live.add_metric(m, float(lane.live))
            footprint.add_metric(m, float(lane.footprint))
            last.add_metric(m, float(lane.load_seconds or 0.0))
            loads.add_metric(m, float(lane.loads))
            load_s.add_metric(m, lane.load_seconds_total)
            unloads.add_metric(m, float(lane.unloads))
            for state, n in sorted(lane.ended.items()):
                requests.add_metric([lane.name, state], float(n))
            prompt.add_metric(m, float(lane.prompt_tokens))
            completion.add_metric(m, float(lane.completion_tokens))
        budget = GaugeMetricFamily("pagewire_memory_budget_bytes", "The memory budget for loaded models.")
        budget.add_metric([], float(self.pool.budget))
        used = GaugeMetricFamily("pagewire_memory_used_bytes", "Footprint of the models loaded or loading.")
        used.add_metric([], float(self.pool.used))
        yield from (loaded, live, footprint, last, loads, load_s, unloads, requests, prompt, completion, budget, used)
