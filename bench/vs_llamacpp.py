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

llama.cpp is not part of pagewire: build it outside the repo (the vendored tree of the newest
`llama-cpp-python` sdist, `cmake -DGGML_NATIVE=ON`) and pass its llama-bench with --llama-bench.

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

from bench.offline_throughput import machine_line

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
    "olmo2-1b": ("olmo2", {
        "vocab_size": 100352, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 16, "num_key_value_heads": 16, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    }),
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


def build_files(shape: str, types: list[str], llama_quantize: Path | None = None) -> dict[str, Path]:
    """The shape's HF folder (bf16) and one GGUF per type under bench/out/vs_llamacpp/, reused
    while their marker says they were written by this FILES_VERSION. Q4_K_M (a mix of types, as
    llama.cpp's users download it) is made from the F16 file by llama.cpp's own llama-quantize."""
    from tests.gguf_files import write_gguf
    from tests.tiny_models import make_tiny_model

    arch, sizes = SHAPES[shape]
    root = OUT_DIR / shape
    hf_dir = root / "hf"
    marker = root / f".complete-v{FILES_VERSION}.json"
    done: dict[str, str] = json.loads(marker.read_text()) if marker.exists() else {}
    if "hf" not in done:
        log(f"writing the random-weight {shape} folder ({arch}, bf16)")
        overrides = {k: v for k, v in sizes.items() if k not in ("vocab_size", "tie_word_embeddings")}
        make_tiny_model(hf_dir, arch, "bfloat16", vocab_size=sizes["vocab_size"],
                        tie_word_embeddings=sizes["tie_word_embeddings"], initializer_range=0.02, **overrides)
        done = {"hf": str(hf_dir)}
        marker.write_text(json.dumps(done))
    files: dict[str, Path] = {}
    vocab = None
    for qtype in (["F16"] if "Q4_K_M" in types and "F16" not in types else []) + types:
        path = root / f"{shape}-{qtype}.gguf"
        if qtype not in done or not path.exists():
            log(f"writing {path.name}")
            if qtype == "Q4_K_M":
                if llama_quantize is None:
                    raise SystemExit("Q4_K_M: pass --llama-quantize (llama.cpp's, built beside llama-bench)")
                cmd = [str(llama_quantize), str(files["F16"]), str(path), "Q4_K_M"]
                log("llama-quantize: " + shlex.join(cmd))
                env = {**os.environ, "LD_LIBRARY_PATH": str(llama_quantize.parent)}
                subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            else:
                vocab = vocab or padded_vocab(sizes["vocab_size"])
                write_gguf(path, hf_dir, qtype, vocab=vocab)
            done[qtype] = str(path)
            marker.write_text(json.dumps(done))
        files[qtype] = path
    return files


def run_pagewire(path: Path, qtype: str, repeats: int, threads: int) -> float:
    """Decode tok/s excluding the first token (bench/offline_throughput.py, its own subprocess)."""
    out = OUT_DIR / "last_pagewire.json"
    quant = "none" if qtype in ("BF16", "F16", "F32") else "gguf"
    cmd = [sys.executable, "-m", "bench.offline_throughput", "--model", str(path), "--only", "decode", "--skip-hf",
           "--repeats", str(repeats), "--threads", str(threads), "--dtype", "bfloat16",
           "--engine-arg", f"quantization={quant}", "--json-out", str(out)]
    log("pagewire: " + shlex.join(cmd))
    subprocess.run(cmd, check=True, cwd=BENCH_DIR.parent, stdout=subprocess.DEVNULL)
    record = json.loads(out.read_text())
    return float(record["results"]["pagewire"]["decode"]["decode_tok_s"])


def run_llamacpp(llama_bench: Path, path: Path, repeats: int, threads: int) -> float:
    """llama-bench's tg128 (tokens/s, mean of `repeats`)."""
    cmd = [str(llama_bench), "-m", str(path), "-p", "0", "-n", "128", "-r", str(repeats), "-t", str(threads),
           "-o", "json"]
    log("llama.cpp: " + shlex.join(cmd))
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    rows = json.loads(done.stdout)
    return float(rows[0]["avg_ts"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="gemma3-1b", choices=sorted(SHAPES))
    p.add_argument("--types", nargs="+", default=["BF16", "Q8_0", "Q4_0"],
                   choices=["BF16", "F16", "Q8_0", "Q4_0", "Q4_K_M"])
    p.add_argument("--llama-bench", type=Path, required=True, help="llama.cpp's llama-bench, built outside the repo")
    p.add_argument("--llama-quantize", type=Path, help="llama.cpp's llama-quantize (for --types Q4_K_M)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per measurement, both programs")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--build-only", action="store_true", help="write the files and stop")
    args = p.parse_args(argv)
    command = shlex.join(sys.orig_argv if argv is None else [sys.executable, "-m", "bench.vs_llamacpp", *argv])
    print(f"command: {command}")
    print(f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"machine: {machine_line()}")
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    files = build_files(args.shape, args.types, args.llama_quantize)
    if args.build_only:
        return 0
    from bench.bandwidth import read_bandwidth_gbs

    print(f"read bandwidth at start: {read_bandwidth_gbs():.1f} GB/s; load average {os.getloadavg()[0]:.2f}")
    ours: dict[str, list[float]] = {t: [] for t in args.types}
    theirs: dict[str, list[float]] = {t: [] for t in args.types}
    for r in range(args.rounds):
        for i, qtype in enumerate(args.types):
            # Alternate who goes first, so a drift in the machine's speed does not favour one side.
            first_ours = (r + i) % 2 == 0
            for side in ((0, 1) if first_ours else (1, 0)):
                if side == 0:
                    ours[qtype].append(run_pagewire(files[qtype], qtype, args.repeats, args.threads))
                else:
                    theirs[qtype].append(run_llamacpp(args.llama_bench, files[qtype], args.repeats, args.threads))
            log(f"round {r + 1} {qtype}: pagewire {ours[qtype][-1]:.2f}, llama.cpp {theirs[qtype][-1]:.2f} tok/s")
    print(f"read bandwidth at end: {read_bandwidth_gbs():.1f} GB/s; load average {os.getloadavg()[0]:.2f}")
    print()
    print(f"| {args.shape} file | pagewire tok/s (per round) | llama.cpp tg128 (per round) | pagewire / llama.cpp |")
    print("|---|---|---|---|")
    for qtype in args.types:
        ratios = [a / b for a, b in zip(ours[qtype], theirs[qtype])]
        print(f"| {qtype} | {' / '.join(f'{x:.2f}' for x in ours[qtype])} | "
              f"{' / '.join(f'{x:.2f}' for x in theirs[qtype])} | "
              f"{min(ratios):.2f}–{max(ratios):.2f} (median {statistics.median(ratios):.2f}) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
