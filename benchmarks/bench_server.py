"""The server under load: throughput and p50 / p95 per action, CRAG on against CRAG off, by worker count.

Starts ``llama-crag serve`` over one index folder for each configuration in turn and
sends the same queries from concurrent clients (the sample questions, in and out of
the corpus, each made unique). ``--llm none`` (the default here) measures retrieval
and the corrective loop without generation, so that the comparison is the loop's own
cost; ``--llm llamacpp`` adds the bundled generator, which then bounds throughput.

    PYTHONPATH=. python benchmarks/bench_server.py --index INDEX_DIR [--workers 1,2] [--queries 300] [--clients 50]

``--threads auto,2`` measures each worker count with serve's default share of the cores
and with 2 threads per worker (``--threads`` of ``llama-crag serve``).

(``PYTHONPATH=.``: the load test and the throwaway PostgreSQL live in ``tests/``.)

``--store postgresql://...`` serves a PostgreSQL store instead (``llama-crag ingest
--store``); ``--store local`` starts a throwaway PostgreSQL with pgvector on a free
loopback port (as the tests do) and ingests ``--docs`` into it first:

    PYTHONPATH=. python benchmarks/bench_server.py --store local --workers 1,2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Dict, List, Optional

from llama_index_crag.datasets import SAMPLE_DIR, load_questions
from llama_index_crag.stores.folder import ingest
from tests.loadtest import ServerProcess, free_port, run_load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--index", default="eval-out/sample-index", help="index folder (made from --docs if absent)")
    parser.add_argument("--docs", default=str(SAMPLE_DIR), help="documents to ingest when --index does not exist")
    parser.add_argument("--store", default=None, help="serve a PostgreSQL store (a URL, or 'local' to start one)")
    parser.add_argument("--table", default="crag", help="the store's name in PostgreSQL (with --store)")
    parser.add_argument("--workers", default="1,2", help="worker counts to measure")
    parser.add_argument("--queries", type=int, default=300, help="queries per configuration")
    parser.add_argument("--clients", type=int, default=50, help="concurrent clients")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every configuration, interleaved (noise)")
    parser.add_argument("--llm", default="none", choices=("none", "llamacpp"), help="generator of the server")
    parser.add_argument(
        "--threads",
        default="auto",
        help="each worker's model threads to measure: auto (serve's default: the cores shared out) or a number",
    )
    parser.add_argument(
        "--crag",
        default=None,
        help="CRAG on, off or both (on,off); default both with --llm llamacpp, on with --llm none (CRAG off is plain "
        "retrieve-then-generate and needs a generator)",
    )
    parser.add_argument("--out", default="eval-out/bench_server", help="folder for bench_server.json and .md")
    args = parser.parse_args()

    server: Any = None
    if args.store == "local":
        from tests.pg_server import LocalPostgres

        server = LocalPostgres().start()
    try:
        rows = measure(args, server.url if server else args.store)
    finally:
        if server is not None:
            server.stop()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_server.json").write_text(json.dumps(rows, indent=2) + "\n")
    lines = [
        f"{args.queries} queries from {args.clients} concurrent clients, generator: {args.llm}, "
        f"served from {'a PostgreSQL store' if args.store else 'an index folder'}",
        "",
        "| round | workers | threads | CRAG | queries/s | errors | cross-talk | p50 ms | p95 ms | correct p50 / p95 "
        "| ambiguous p50 / p95 | incorrect p50 / p95 | disabled p50 / p95 | RSS per process, MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [
            f"{r[a]['p50_ms']:.0f} / {r[a]['p95_ms']:.0f} (n={r[a]['n']})" if a in r else "-"
            for a in ("correct", "ambiguous", "incorrect", "disabled")
        ]
        lines.append(
            f"| {r['round']} | {r['workers']} | {r['threads']} | {'on' if r['crag'] else 'off'} | "
            f"{r['queries_per_s']} | {r['errors']} | "
            f"{r['cross_talk']} | {r['all']['p50_ms']:.0f} | {r['all']['p95_ms']:.0f} | "
            + " | ".join(cells)
            + f" | {', '.join(f'{m:,.0f}' for m in r['rss_mb'])} |"
        )
    (out / "bench_server.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def measure(args: argparse.Namespace, store: Optional[str]) -> List[Dict[str, Any]]:
    """Each configuration (worker count, CRAG on and off) in each round: one summary of ``run_load`` each."""
    if store is not None:
        if args.store == "local":
            from llama_index_crag.stores import postgres

            target = postgres.PostgresStore(store, table=args.table)
            print(postgres.ingest(args.docs, target).summary())
            target.close()
        index, source = "", ["--store", store, "--table", args.table]
    else:
        if not (Path(args.index) / "manifest.json").exists():
            print(ingest(args.docs, args.index).summary())
        index, source = args.index, []
    questions = [q.question for q in load_questions(args.docs if Path(args.docs, "questions.jsonl").exists()
                                                     else SAMPLE_DIR)]  # fmt: skip
    rows: List[Dict[str, Any]] = []
    chosen = args.crag or ("on" if args.llm == "none" else "on,off")
    crags = [{"on": True, "off": False}[c.strip()] for c in chosen.split(",")]
    if not all(crags) and args.llm == "none":
        raise SystemExit("--crag off needs --llm llamacpp: CRAG off is plain retrieve-then-generate")
    configurations = [
        (int(w), t.strip(), crag) for w in args.workers.split(",") for t in args.threads.split(",") for crag in crags
    ]
    for round_ in range(1, args.rounds + 1):
        for workers, threads, crag in configurations:
            extra = [*source, "--llm", args.llm] + ([] if crag else ["--disable-crag"])
            extra += [] if threads == "auto" else ["--threads", threads]
            with ServerProcess(index, free_port(), workers=workers, extra=extra) as served:
                run_load(served.url, questions, total=min(20, args.queries), concurrency=4)  # warm each worker
                result = run_load(served.url, questions, total=args.queries, concurrency=args.clients)
                memory = served.memory_mb()
            summary = {"round": round_, "workers": workers, "threads": threads, "crag": crag, **result.summary()}
            summary["rss_mb"] = memory
            summary["source"] = "store" if store else "index"
            rows.append(summary)
            print(json.dumps(summary), flush=True)
    return rows


if __name__ == "__main__":
    main()
