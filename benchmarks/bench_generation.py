"""Generation speed of the installed llama.cpp build with the bundled SmolLM2: portable against native, one build a run.

Prints the CPU features the build compiled in and the median tokens per second over
five 128-token generations. To compare two builds on one machine, install the other
one into a folder of its own and put it first on the path, alternating the runs:

    python benchmarks/bench_generation.py
    pip install --no-deps --target /tmp/native llama_cpp_python-*.whl   # a wheel built with GGML_NATIVE
    PYTHONPATH=/tmp/native python benchmarks/bench_generation.py
"""

from __future__ import annotations

import json
import statistics
import time

import llama_cpp
from llama_cpp import Llama

from llama_index_crag.local.bundled import bundled_gguf_path
from llama_index_crag.local.llamacpp import chatml_completion_to_prompt
from llama_index_crag.local.portable import llama_cpp_features


def main() -> None:
    llm = Llama(model_path=str(bundled_gguf_path()), n_ctx=1024, n_threads=2, seed=0, verbose=False)
    prompt = chatml_completion_to_prompt("Write a short story about a lighthouse keeper.")
    rates = []
    for _ in range(5):
        start = time.perf_counter()
        out = llm(prompt, max_tokens=128, temperature=0.0)
        rates.append(out["usage"]["completion_tokens"] / (time.perf_counter() - start))
    print(
        json.dumps(
            {
                "library": llama_cpp.__file__,
                "features": llama_cpp_features(),
                "tokens_per_s_median": round(statistics.median(rates), 1),
                "runs": [round(r, 1) for r in rates],
            }
        )
    )


if __name__ == "__main__":
    main()
