"""Child process of test_spec_exact_families.py: greedy plain decoding and n-gram speculation on
one model under the kernel family named by $PAGEWIRE_CPU_ISA (set before anything imports the
extension, so the Python-side rules and the C++ ops agree on the family). Each prompt runs alone
in each engine. Prints one JSON object: per prompt the plain and speculative token ids, and the
speculation counters (so a pass cannot come from never speculating).

    python -m tests.engine.spec_exact_run MODEL '{"dtype": ...}' '["prompt", [1, 2, 3], ...]' MAX_TOKENS
"""
from __future__ import annotations

import json
import sys
from typing import Any


def main() -> None:
    from server.engine.config import EngineConfig
    from server.engine.engine import LLMEngine
    from server.engine.sampling_params import SamplingParams
    from server.kernels.ops import cpu_isa

    model, kw, prompts, max_tokens = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
            "disable_by_batch_size": 0, "min_acceptance_rate": 0.0}
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    result: dict[str, Any] = {"isa": cpu_isa()}
    table = None
    for name, sc in (("plain", None), ("spec", spec)):
        engine = LLMEngine(EngineConfig(model=model, speculative_config=sc, **kw))
        # One server engine decodes and verifies under one autotuned table; two engines tuning
        # apart can pick different prefill paths from timing noise alone (a loaded machine), and
        # the prompt's KV would then round apart before speculation does anything. The claim
        # tested is speculation's, so the speculative engine follows the plain engine's table.
        if table is None:
            table = engine.linear_table
        else:
            engine.linear_table = table
        result[f"{name}_deterministic"] = engine.deterministic
        outs = []
        for i, p in enumerate(prompts):
            ids = engine.tokenizer.encode(p) if isinstance(p, str) else p
            engine.add_request(str(i), ids, params)
            toks: list[int] = []
            while engine.has_unfinished_requests():
                for d in engine.step():
                    toks += [t for s in d.samples for t in s.token_ids]
            outs.append(toks)
        result[name] = outs
        if sc is not None:
            st = engine.stats().spec
            assert st is not None
            result["proposed"], result["accepted"] = st.num_proposed, st.num_accepted
    print(json.dumps(result))


if __name__ == "__main__":
    main()
