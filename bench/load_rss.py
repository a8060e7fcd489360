"""Where a GGUF load's resident memory goes: /proc/self/status (RssAnon, RssFile) at each stage of
one process -- start, `import torch`, `import server`, after LLM(...) (quantization="gguf", bf16,
the KV pool bench/offline_throughput.py's decode run allocates), after one short generate -- then
the model's tensors by kind (deduplicated by storage) beside the file's tensors by GGUF type, and
RSS / (file + KV pool) as bench/vs_llamacpp.py's memory table computes it (whole process, and
"load's own": less the RSS just before LLM(...)).

    PYTHONPATH=. .venv/bin/python -m bench.load_rss /tmp/moebench/qwen3moe-2.5b/qwen3moe-2.5b-Q4_K_M.gguf

Memory only: it takes no timings (shared hosts are fine).
"""
from __future__ import annotations

import argparse
import collections
import os
from typing import Any

# vs_llamacpp's decode run: max_model_len and kv_cache_tokens of offline_throughput's decode workload.
BENCH_MAX_MODEL_LEN, BENCH_KV_TOKENS = 1025, 18912


def status() -> dict[str, int]:
    """VmRSS / RssAnon / RssFile / RssShmem / VmHWM of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def show(stage: str) -> dict[str, int]:
    s = status()
    print(f"{stage:24s} " + "  ".join(f"{k} {v / 2**20:7.1f}" for k, v in s.items()) + "  (MiB)", flush=True)
    return s


def model_tensors(model: Any) -> dict[str, int]:
    """Bytes of every tensor the model holds (parameters, buffers, QuantizedWeight / QuantizedExperts /
    QuantizedParts blocks, tensors in plain attributes and lists), by kind, each storage once."""
    import torch

    seen: set[int] = set()
    by: collections.Counter[str] = collections.Counter()

    def add(kind: str, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            return
        seen.add(storage.data_ptr())
        by[kind] += storage.nbytes()

    def visit(name: str, v: Any, depth: int = 0) -> None:
        if isinstance(v, torch.Tensor):
            add(f"tensor {v.dtype}".replace("torch.", ""), v)
        elif hasattr(v, "qtype") and isinstance(getattr(v, "data", None), torch.Tensor):
            add(f"{type(v).__name__} {v.qtype}", v.data)
        elif isinstance(v, (list, tuple)) and depth < 2:
            for x in v:
                visit(name, x, depth + 1)
        elif depth < 2 and hasattr(v, "__dict__") and type(v).__module__.startswith("server.") \
                and not isinstance(v, torch.nn.Module):
            for k, x in vars(v).items():
                visit(k, x, depth + 1)

    for module in model.modules():
        for k, v in vars(module).items():
            if k in ("_parameters", "_buffers"):
                for t in v.values():
                    if t is not None:
                        visit(k, t)
            elif not k.startswith("_modules"):
                visit(k, v)
    return dict(by)


def file_tensors(path: str) -> dict[str, int]:
    from server.models.gguf_file import GGUFFile

    by: collections.Counter[str] = collections.Counter()
    for t in GGUFFile.open(path).tensors.values():
        by[t.type_name] += int(t.data.nbytes)
    return dict(by)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="a .gguf file")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-model-len", type=int, default=BENCH_MAX_MODEL_LEN)
    p.add_argument("--kv-cache-tokens", type=int, default=BENCH_KV_TOKENS)
    args = p.parse_args(argv)
    show("start")
    import torch

    show("import torch")
    from server import LLM, SamplingParams

    show("import server")
    before = status()
    llm = LLM(args.path, quantization="gguf", dtype="bfloat16", max_model_len=args.max_model_len,
              kv_cache_tokens=args.kv_cache_tokens, num_threads=args.threads)
    after = show("after LLM(...)")
    from bench.offline_throughput import _kv_pool_bytes

    kv = _kv_pool_bytes(llm.engine.runner.kv_caches)
    size = os.path.getsize(args.path)
    llm.generate(["hello world"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    show("after generate")
    held = model_tensors(llm.engine.model)
    print("model tensors, MiB: " + ", ".join(f"{k} {v / 2**20:.1f}" for k, v in sorted(held.items()))
          + f"; total {sum(held.values()) / 2**20:.1f}")
    in_file = file_tensors(args.path)
    print("file tensors, MiB:  " + ", ".join(f"{k} {v / 2**20:.1f}" for k, v in sorted(in_file.items()))
          + f"; total {sum(in_file.values()) / 2**20:.1f}")
    rest = after["RssAnon"] - before["RssAnon"] - sum(held.values()) - kv
    print(f"file {size / 2**20:.1f} MiB, KV pool {kv / 2**20:.1f} MiB; load's anonymous memory beyond model "
          f"tensors + KV pool: {rest / 2**20:.1f} MiB; RssFile grew {(after['RssFile'] - before['RssFile']) / 2**20:.1f}")
    print(f"RSS after load / (file + KV) = {after['VmRSS'] / (size + kv):.3f} (whole process), "
          f"{(after['VmRSS'] - before['VmRSS']) / (size + kv):.3f} (load's own)")
    del torch
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
