"""pagewire beside llama.cpp on the same GGUF files of a family's random-weight shape: single-stream
decode, interleaved in one run.

For a named shape (a family's real sizes, e.g. Gemma 3 1B), it writes a random-weight Hugging Face
folder (tests.tiny_models, std 0.02) and GGUF copies of it in each requested type (every 2-D
weight in that type, as `llama-quantize --pure` would; norms F32), laid out as llama.cpp's
converter does (tests.gguf_files). Then, per round and per file, alternating which goes first:

  * pagewire: `bench/offline_throughput.py --model FILE --only decode --skip-hf`, decode tok/s
    excluding the first token (median of --repeats); BF16 files load as bf16 weights, quantised
    files keep their blocks (`quantization=gguf`);
  * llama.cpp: `llama-bench -m FILE -p 0 -n 128 -r R -t THREADS`, tg128 (mean of R).

Per file it also prints what a decode step reads of the file's weights, counted from its stored
types (bench.moe_gguf.decode_bytes_per_token: the top-k experts' share of each expert tensor,
attention, routers, norms, one embedding row, the lm_head), the MBU of both programs against the
best read bandwidth bench/bandwidth.py measured in the run (start and end), and pagewire's RSS
after load beside the file's size plus the KV pool it allocated.

The mixture-of-experts shape (`qwen3moe-2.5b`, issue 27) has no Hugging Face folder: its F16 file is
written tensor by tensor (bench.moe_gguf) and every other type is made from it by llama.cpp's own
llama-quantize (Q8_0 and Q4_K_M as a user downloads them), so it needs --llama-quantize.

llama.cpp is not part of pagewire: build it outside the repo (the vendored tree of the newest
`llama-cpp-python` sdist, `cmake -DGGML_NATIVE=ON`) and pass its llama-bench with --llama-bench.

Example (issue 27's MoE bar; files under /tmp; `--shape qwen3moe-5b` for the 48-layer shape, whose
files are large enough that the interpreter's and torch's fixed ~220 MiB stay a small part of the
RSS bar, as they are for real MoE files):
    .venv/bin/python -m bench.vs_llamacpp --shape qwen3moe-2.5b --types Q8_0 Q4_K_M --files-dir /tmp/moebench \
        --llama-bench $LCPP/llama-bench --llama-quantize $LCPP/llama-quantize --rounds 2 --repeats 3 --threads 2

Example (issue 28's bar: the Qwen3.5-shaped hybrid, BF16 and Q8_0; llama.cpp's qwen35 needs the
rope.dimension_sections key, which the test writer adds as its converter does):
    .venv/bin/python -m bench.vs_llamacpp --shape qwen35-1b --types Q8_0 BF16 --files-dir /tmp/hybrid28 \
        --llama-bench /tmp/lcpp/llama.cpp/build/bin/llama-bench --rounds 2 --repeats 1

Example (given files: SmolLM2's Q4_K_M as llama-quantize writes it from the BF16 file, mostly Q5_0,
which pagewire keeps as Q8_0 blocks; MBU counts the file's stored bytes):
    .venv/bin/python -m bench.vs_llamacpp --files /tmp/smol/smol-Q4_K_M.gguf /tmp/s37/files/smol-IQ4_NL.gguf \
        --llama-bench $LCPP/llama-bench --rounds 2 --repeats 3 --threads 2

Example (issue 26's bar: Gemma-3-1B shape, at least 1.0x llama.cpp):
    .venv/bin/python -m bench.vs_llamacpp --shape gemma3-1b --types BF16 Q8_0 Q4_0 \
        --llama-bench /tmp/lcpp/llama.cpp/build/bin/llama-bench --rounds 2
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.moe_gguf import MoeShape, decode_bytes_per_token, tensor_types, write_random_moe_f16
from bench.offline_throughput import DECODE_OUTPUT_LEN, DECODE_PROMPT_LEN, machine_line

BENCH_DIR = Path(__file__).resolve().parent
OUT_DIR = BENCH_DIR / "out" / "vs_llamacpp"
# Bump when what build_files writes changes, so cached files are rebuilt.
FILES_VERSION = 1

# Real sizes of the families' released checkpoints (their config.json); the weights are random.
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma3-1b": ("gemma3", {
        "vocab_size": 262144, "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "query_pre_attn_scalar": 256,
        "sliding_window": 512, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
    }),
    # SmolLM2-135M's layout (30 Llama layers, heads of 64, 1536-wide MLP, 49152 tokens, tied) with
    # a 512-wide residual instead of 576: every row a whole number of 256-value K-quant
    # super-blocks, so llama-quantize's Q4_K_M is Q4_K and Q6_K throughout (on the real 576-wide
    # model 166 of its 211 matrices fall back to Q5_0, a type pagewire does not keep).
    "smollm2-k256": ("llama", {
        "vocab_size": 49152, "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
    }),
    # TinyLlama-1.1B's sizes (22 Llama layers, hidden 2048, MLP 5632, 32 heads of 64 with 4 KV heads,
    # 32,000 tokens, untied): issue 31's "random-weight Llama shape of about 1 B parameters".
    "llama-1b": ("llama", {
        "vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
        "num_attention_heads": 32, "num_key_value_heads": 4, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    }),
    "olmo2-1b": ("olmo2", {
        "vocab_size": 100352, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 16, "num_key_value_heads": 16, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    }),
    # Qwen3.5's small-model layout (Qwen3.5-0.8B's config: hidden 1024, 24 layers in six groups of
    # three Gated DeltaNet layers and one gated full-attention layer, DeltaNet heads 16 x 128 for q, k
    # and v with a 4-tap conv, attention 8 query / 2 KV heads of 256 with the output gate and a
    # quarter of each head rotary, every norm 1 + w, the 248,320-token vocabulary, tied) with a
    # 6144-wide MLP (Qwen3.5-2B's) to bring it to about 1 B: 0.94 B parameters, 0.25 B of them the
    # embedding table.
    "qwen35-1b": ("qwen3_5", {
        "vocab_size": 248320, "hidden_size": 1024, "intermediate_size": 6144, "num_hidden_layers": 24,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
        "linear_num_key_heads": 16, "linear_num_value_heads": 16, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    }),
}

# Mixture-of-experts shapes (random weights, written without an HF folder). qwen3moe-2.5b: Qwen3-MoE's
# layout at Qwen3-30B-A3B's expert count and top-k (128, 8), hidden 1024, 24 layers, heads of 128 (8 / 2
# KV), experts of 256 (every row whole K-quant super-blocks), a 32,000-token vocabulary, untied:
# 2.55 B parameters, 0.28 B active (11 %, the whole embedding table counted). qwen3moe-5b: the same at
# Qwen3-30B-A3B's 48 layers: 4.98 B parameters, 0.50 B active (10 %). Its files are large enough that the
# interpreter's and torch's fixed ~260 MiB is a small share of the memory bar, as it is for real MoE files.
MOE_SHAPES: dict[str, MoeShape] = {
    "qwen3moe-2.5b": MoeShape(vocab_size=32000, hidden_size=1024, num_layers=24, num_heads=8, num_kv_heads=2,
                              head_dim=128, num_experts=128, experts_per_tok=8, moe_intermediate_size=256),
    "qwen3moe-5b": MoeShape(vocab_size=32000, hidden_size=1024, num_layers=48, num_heads=8, num_kv_heads=2,
                            head_dim=128, num_experts=128, experts_per_tok=8, moe_intermediate_size=256),
}


def log(msg: str) -> None:
    print(f"[{datetime.datetime.now():%H:%M:%S}] {msg}", file=sys.stderr, flush=True)


def padded_vocab(size: int) -> tuple[list[str], list[str], list[int]]:
    """A byte-level BPE vocabulary trained on the demo corpus, padded with plain tokens to `size`:
    the benchmark feeds token ids, so only the count matters (both programs load the table)."""
    from tests.gguf_files import train_byte_level_vocab

    tokens, merges, types = train_byte_level_vocab(min(size, 4096))
    pad = size - len(tokens)
    return tokens + [f"<pad{i}>" for i in range(pad)], merges, types + [1] * pad


def build_files(shape: str, types: list[str], llama_quantize: Path | None = None,
                files_dir: Path = OUT_DIR) -> dict[str, Path]:
    """The shape's files under `files_dir`/SHAPE/, reused while their marker says they were written
    by this FILES_VERSION: a dense shape's HF folder (bf16) and one GGUF per type written from it;
    an MoE shape's F16 GGUF (bench.moe_gguf). Q4_K_M (a mix of types, as llama.cpp's users download
    it), Q4_1 (which the test writer has no quantiser for), and every quantised type of an MoE shape,
    are made from the F16 file by llama.cpp's own llama-quantize."""
    from tests.gguf_files import write_gguf
    from tests.tiny_models import make_tiny_model

    moe = MOE_SHAPES.get(shape)
    root = files_dir / shape
    root.mkdir(parents=True, exist_ok=True)
    hf_dir = root / "hf"
    marker = root / f".complete-v{FILES_VERSION}.json"
    done: dict[str, str] = json.loads(marker.read_text()) if marker.exists() else {}
    if moe is None and "hf" not in done:
        arch, sizes = SHAPES[shape]
        log(f"writing the random-weight {shape} folder ({arch}, bf16)")
        overrides = {k: v for k, v in sizes.items() if k not in ("vocab_size", "tie_word_embeddings")}
        make_tiny_model(hf_dir, arch, "bfloat16", vocab_size=sizes["vocab_size"],
                        tie_word_embeddings=sizes["tie_word_embeddings"], initializer_range=0.02, **overrides)
        done = {"hf": str(hf_dir)}
        marker.write_text(json.dumps(done))
    vocab_size = moe.vocab_size if moe is not None else SHAPES[shape][1]["vocab_size"]
    from_f16 = [t for t in types if t in ("Q4_K_M", "Q4_1") or (moe is not None and t != "F16")]
    files: dict[str, Path] = {}
    vocab = None
    for qtype in (["F16"] if from_f16 and "F16" not in types else []) + types:
        path = root / f"{shape}-{qtype}.gguf"
        if qtype not in done or not path.exists():
            log(f"writing {path}")
            if qtype in from_f16:
                if llama_quantize is None:
                    raise SystemExit(f"{qtype}: pass --llama-quantize (llama.cpp's, built beside llama-bench)")
                cmd = [str(llama_quantize), str(files["F16"]), str(path), qtype]
                log("llama-quantize: " + shlex.join(cmd))
                env = {**os.environ, "LD_LIBRARY_PATH": str(llama_quantize.parent)}
                subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            else:
                vocab = vocab or padded_vocab(vocab_size)
                if moe is not None:
                    write_random_moe_f16(path, moe, vocab)
                else:
                    write_gguf(path, hf_dir, qtype, vocab=vocab)
            done[qtype] = str(path)
            marker.write_text(json.dumps(done))
        files[qtype] = path
    return files


def pagewire_command(path: Path, qtype: str, repeats: int, threads: int) -> list[str]:
    """bench/offline_throughput.py's decode measurement of one file: BF16/F16 files load as bf16
    weights, quantised files keep their blocks (`quantization=gguf`)."""
    quant = "none" if qtype in ("BF16", "F16", "F32") else "gguf"
    return [sys.executable, "-m", "bench.offline_throughput", "--model", str(path), "--only", "decode", "--skip-hf",
            "--repeats", str(repeats), "--threads", str(threads), "--dtype", "bfloat16",
            "--engine-arg", f"quantization={quant}", "--json-out", str(OUT_DIR / "last_pagewire.json")]


def llamacpp_command(llama_bench: Path, path: Path, repeats: int, threads: int) -> list[str]:
    return [str(llama_bench), "-m", str(path), "-p", "0", "-n", "128", "-r", str(repeats), "-t", str(threads),
            "-o", "json"]


def run_pagewire(path: Path, qtype: str, repeats: int, threads: int) -> dict[str, Any]:
    """offline_throughput's pagewire record (its own subprocess): decode tok/s excluding the first
    token under ["decode"]["decode_tok_s"], rss_after_load_bytes, kv_pool_bytes."""
    cmd = pagewire_command(path, qtype, repeats, threads)
    log("pagewire: " + shlex.join(cmd))
    subprocess.run(cmd, check=True, cwd=BENCH_DIR.parent, stdout=subprocess.DEVNULL)
    record = json.loads((OUT_DIR / "last_pagewire.json").read_text())
    return dict(record["results"]["pagewire"])


def run_llamacpp(llama_bench: Path, path: Path, repeats: int, threads: int) -> float:
    """llama-bench's tg128 (tokens/s, mean of `repeats`)."""
    cmd = llamacpp_command(llama_bench, path, repeats, threads)
    log("llama.cpp: " + shlex.join(cmd))
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    rows = json.loads(done.stdout)
    return float(rows[0]["avg_ts"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="gemma3-1b", choices=sorted([*SHAPES, *MOE_SHAPES]))
    p.add_argument("--types", nargs="+", default=["BF16", "Q8_0", "Q4_0"],
                   choices=["BF16", "F16", "Q8_0", "Q4_0", "Q4_1", "Q4_K_M"])
    p.add_argument("--llama-bench", type=Path, required=True, help="llama.cpp's llama-bench, built outside the repo")
    p.add_argument("--llama-quantize", type=Path, help="llama.cpp's llama-quantize (Q4_K_M, and an MoE shape's types)")
    p.add_argument("--files-dir", type=Path, default=OUT_DIR, help="where the model files are written and reused")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per measurement, both programs")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--build-only", action="store_true", help="write the files and stop")
    p.add_argument("--files", type=Path, nargs="+",
                   help="run these GGUF files (downloaded, or made by llama-quantize) instead of a shape's")
    args = p.parse_args(argv)
    command = shlex.join(sys.orig_argv if argv is None else [sys.executable, "-m", "bench.vs_llamacpp", *argv])
    print(f"command: {command}")
    print(f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"machine: {machine_line()}")
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    if args.files:
        # Each file under its name; a file whose matrices are all float runs as bf16 weights.
        files = {f.name: f for f in args.files}
        args.types, args.shape = list(files), "given"
        kinds = {name: "BF16" if set(tensor_types(f)) <= {"F32", "F16", "BF16"} else "Q" for name, f in files.items()}
    else:
        files = build_files(args.shape, args.types, args.llama_quantize, args.files_dir)
        kinds = {t: t for t in args.types}
    if args.build_only:
        return 0
    from bench.bandwidth import measure

    if args.shape in MOE_SHAPES:
        total, active = MOE_SHAPES[args.shape].parameters()
        print(f"{args.shape}: {total / 1e9:.3f} B parameters, {active / 1e9:.3f} B active ({active / total:.1%})")
    for qtype in args.types:
        print(f"{qtype}: {files[qtype]} ({files[qtype].stat().st_size / 2**20:.0f} MiB; tensors by type "
              f"{tensor_types(files[qtype])})")
        print(f"  pagewire:  {shlex.join(pagewire_command(files[qtype], kinds[qtype], args.repeats, args.threads))}")
        print(f"  llama.cpp: {shlex.join(llamacpp_command(args.llama_bench, files[qtype], args.repeats, args.threads))}")
    bandwidths = [measure()]
    print(f"read bandwidth at start: {bandwidths[0].line()}; load average {os.getloadavg()[0]:.2f}", flush=True)
    ours: dict[str, list[dict[str, Any]]] = {t: [] for t in args.types}
    theirs: dict[str, list[float]] = {t: [] for t in args.types}
    for r in range(args.rounds):
        for i, qtype in enumerate(args.types):
            # Alternate who goes first, so a drift in the machine's speed does not favour one side.
            first_ours = (r + i) % 2 == 0
            for side in ((0, 1) if first_ours else (1, 0)):
                if side == 0:
                    ours[qtype].append(run_pagewire(files[qtype], kinds[qtype], args.repeats, args.threads))
                else:
                    theirs[qtype].append(run_llamacpp(args.llama_bench, files[qtype], args.repeats, args.threads))
            log(f"round {r + 1} {qtype}: pagewire {ours[qtype][-1]['decode']['decode_tok_s']:.2f}, "
                f"llama.cpp {theirs[qtype][-1]:.2f} tok/s; load average {os.getloadavg()[0]:.2f}")
    bandwidths.append(measure())
    print(f"read bandwidth at end: {bandwidths[1].line()}; load average {os.getloadavg()[0]:.2f}")
    report(args.shape, args.types, files, ours, theirs, max(b.best_gbs for b in bandwidths))
    return 0


def report(shape: str, types: list[str], files: dict[str, Path], ours: dict[str, list[dict[str, Any]]],
           theirs: dict[str, list[float]], bandwidth_gbs: float) -> None:
    """The comparison table, then what each decode step reads and the MBU it implies, then memory."""
    rate = {t: [float(rec["decode"]["decode_tok_s"]) for rec in ours[t]] for t in types}
    print()
    print(f"| {shape} file | pagewire tok/s (per round) | llama.cpp tg128 (per round) | pagewire / llama.cpp |")
    print("|---|---|---|---|")
    for qtype in types:
        ratios = [a / b for a, b in zip(rate[qtype], theirs[qtype])]
        print(f"| {qtype} | {' / '.join(f'{x:.2f}' for x in rate[qtype])} | "
              f"{' / '.join(f'{x:.2f}' for x in theirs[qtype])} | "
              f"{min(ratios):.2f}–{max(ratios):.2f} (median {statistics.median(ratios):.2f}) |")
    print()
    print(f"MBU = bytes read per token x tok/s / {bandwidth_gbs:.1f} GB/s (bench/bandwidth.py's best in this run); "
          f"bytes from the file's stored types, KV at the decode's mean context "
          f"({DECODE_PROMPT_LEN + DECODE_OUTPUT_LEN // 2} tokens) added")
    print("| file | experts / embedding row / lm_head / rest, MB | + KV, MB | bytes per token, MB | "
          "pagewire MBU (best round) | llama.cpp MBU (best round) | pagewire's own count, MB |")
    print("|---|---|---|---|---|---|---|")
    for qtype in types:
        b = decode_bytes_per_token(files[qtype])
        rec = ours[qtype][0]
        # offline_throughput's own count adds the KV at the same context to what the model holds in
        # memory; its KV part is what this file's layers read too.
        kv = int(rec["kv_cache_bytes_per_token"]) * (DECODE_PROMPT_LEN + DECODE_OUTPUT_LEN // 2)
        per_token = b.total + kv
        mbu = [100 * per_token * x / (bandwidth_gbs * 1e9) for x in (max(rate[qtype]), max(theirs[qtype]))]
        print(f"| {qtype} | {b.experts / 1e6:.1f} / {b.embedding_row / 1e6:.3f} / {b.lm_head / 1e6:.1f} / "
              f"{b.rest / 1e6:.1f} | {kv / 1e6:.1f} | {per_token / 1e6:.1f} | {mbu[0]:.0f} % | {mbu[1]:.0f} % | "
              f"{rec['decode_bytes_per_token'] / 1e6:.1f} |")
    print()
    print("RSS after load: the whole process (interpreter, torch and server's imports included), and less "
          "the RSS the same process had just before LLM(...) ('load's own')")
    print("| file | file size, MiB | KV pool, MiB | pagewire RSS after load, MiB (per round) | RSS / (file + KV) | "
          "load's own / (file + KV) |")
    print("|---|---|---|---|---|---|")
    for qtype in types:
        size, kv_pool = files[qtype].stat().st_size, int(ours[qtype][0]["kv_pool_bytes"])
        rss = [int(rec["rss_after_load_bytes"]) for rec in ours[qtype]]
        own = [int(rec["rss_after_load_bytes"]) - int(rec["rss_before_load_bytes"]) for rec in ours[qtype]]
        print(f"| {qtype} | {size / 2**20:.0f} | {kv_pool / 2**20:.0f} | "
              f"{' / '.join(f'{x / 2**20:.0f}' for x in rss)} | "
              f"{' / '.join(f'{x / (size + kv_pool):.2f}' for x in rss)} | "
              f"{' / '.join(f'{x / (size + kv_pool):.2f}' for x in own)} |")

if __name__ == "__main__":
    raise SystemExit(main())
