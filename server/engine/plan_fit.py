"""`pagewire plan` for several models: each model's footprint (weights, activations, KV pool, as
`make_plan` computes them and as the model pool counts them against `--memory-budget`) and how
they fit the budget: all at once, or how many the pool can keep loaded together (the rest load
on demand, unloading the least recently used idle model)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from server.engine.plan import Plan


@dataclass(frozen=True)
class ModelFit:
    name: str
    plan: Plan

    @property
    def footprint(self) -> int:
        return self.plan.weights.total + self.plan.activations + self.plan.layout.total_bytes


def fit_json(fits: list[ModelFit], budget: Optional[int]) -> dict[str, Any]:
    total = sum(f.footprint for f in fits)
    return {
        "budget_bytes": budget, "total_bytes": total, "all_fit": budget is None or total <= budget,
        "models": [{"name": f.name, "weight_bytes": f.plan.weights.total, "activation_bytes": f.plan.activations,
                    "kv_bytes": f.plan.layout.total_bytes, "footprint_bytes": f.footprint,
                    "max_model_len": f.plan.layout.max_model_len, "fits_alone": budget is None or f.footprint <= budget}
                   for f in fits],
    }


def _mib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def render_fit(fits: list[ModelFit], budget: Optional[int]) -> str:
    name_w = max(8, *(len(f.name) for f in fits))
    lines = [f"{'model':<{name_w}}  {'weights':>10}  {'activations':>11}  {'KV pool':>10}  {'footprint':>10}  "
             f"{'max_model_len':>13}"]
    for f in fits:
        p = f.plan
        lines.append(f"{f.name:<{name_w}}  {_mib(p.weights.total):>10}  {_mib(p.activations):>11}  "
                     f"{_mib(p.layout.total_bytes):>10}  {_mib(f.footprint):>10}  {p.layout.max_model_len:>13}")
    total = sum(f.footprint for f in fits)
    lines.append(f"{'all':<{name_w}}  {'':>10}  {'':>11}  {'':>10}  {_mib(total):>10}")
    if budget is None:
        lines.append("budget: none given (--memory-budget); serve's default is 90% of the memory available at start")
        return "\n".join(lines)
    lines.append(f"budget: {_mib(budget)}")
    too_big = [f.name for f in fits if f.footprint > budget]
    if too_big:
        lines.append(f"does not fit even alone: {', '.join(too_big)} (serve refuses to start)")
    elif total <= budget:
        lines.append(f"all {len(fits)} fit at once ({_mib(budget - total)} to spare)")
    else:
        # The most that can be loaded together: the smallest first.
        acc, n = 0, 0
        for fp in sorted(f.footprint for f in fits):
            if acc + fp > budget:
                break
            acc, n = acc + fp, n + 1
        largest = sorted((f.footprint for f in fits), reverse=True)
        acc_l, m = 0, 0
        for fp in largest:
            if acc_l + fp > budget:
                break
            acc_l, m = acc_l + fp, m + 1
        together = f"{n}" if max(1, m) == n else f"between {max(1, m)} and {n} (by which are loaded)"
        lines.append(f"not all at once: {together} stay loaded together; a request for another loads it on demand, "
                     "unloading the least recently used idle model first")
    return "\n".join(lines)
