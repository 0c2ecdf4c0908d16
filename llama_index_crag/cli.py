"""The ``llama-crag`` command line."""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from tqdm import tqdm

from llama_index_crag.datasets import SAMPLE_DIR, Question, load_documents, load_questions
from llama_index_crag.evaluation.command import add_eval_parser
from llama_index_crag.local.models import DEFAULT_OLLAMA_MODEL, DEFAULT_OLLAMA_URL
from llama_index_crag.local.portable import GeneratorUnavailable


def _doctor(args: argparse.Namespace) -> int:
    from llama_index_crag.local.doctor import report, run_checks

    checks = run_checks(args.ollama_url, args.ollama_model, args.gguf)
    print(report(checks, as_json=args.json))
    return 0 if all(c.ok for c in checks) else 1


def _demo(args: argparse.Namespace) -> int:
    from llama_index.core import VectorStoreIndex

    from llama_index_crag.core.engine import CorrectiveQueryEngine
    from llama_index_crag.local.models import default_embed_model, default_llm, ollama_has_model

    folder = Path(args.dataset)
    documents = load_documents(folder)
    questions: List[Question] = load_questions(folder)[: args.limit]
    say = functools.partial(print, file=sys.stderr if args.json else sys.stdout)
    say(f"Corpus: {len(documents)} documents from {folder}; {len(questions)} questions.")
    generate = args.generate or args.disable_crag
    llm = None
    if generate or ollama_has_model(args.ollama_url, args.ollama_model):
        try:
            llm, described = default_llm(args.ollama_url, args.ollama_model, gguf=args.gguf)
            say(f"Generator: {described}.")
        except (GeneratorUnavailable, ImportError, FileNotFoundError) as exc:
            say(f"Generator: none. {exc}")
    else:
        say("Generator: none needed: answers quote the documents (--generate: the bundled SmolLM2 answers instead).")
    say("Embeddings: bundled all-MiniLM-L6-v2 (offline). Fallback: BM25 + sentence windows.")
    index = VectorStoreIndex.from_documents(documents, embed_model=default_embed_model(), show_progress=True)
    engine = CorrectiveQueryEngine.from_defaults(
        index=index,
        llm=llm,
        enabled=False if args.disable_crag else None,
        explain=True if args.explain else None,
        calibration_path=args.calibration,
        answer_mode="generate" if generate and llm is not None else None,
    )
    s = engine.settings
    say(f"CRAG {'on' if s.enabled else 'off'}: scorer {engine.grader.scorer.name}, upper={s.upper}, lower={s.lower}")
    if engine.answer_mode == "extract":
        say("Answers: quoted from the graded passages, with their sources; nothing is generated.\n")
    else:
        say(f"Answers: generated, each checked against its passages (an unsupported one: {s.on_ungrounded}).\n")
    rows = []
    for q in tqdm(questions, desc="questions", disable=not args.progress):
        response = engine.query(q.question)
        crag = (response.metadata or {})["crag"]
        sources = [n.node.metadata.get("doc_id", n.node.node_id) for n in response.source_nodes]
        answer = str(response).strip()
        rows.append({"qid": q.qid, "question": q.question, "answer": answer, "sources": sources, **crag})
        if not args.json:
            _print_row(q, answer, crag, sources)
    if args.json:
        json.dump(rows, sys.stdout, indent=2, default=str)
        print()
    else:
        _print_summary(rows)
    return 0


def _print_row(q: Question, answer: str, crag: dict, sources: Sequence[str]) -> None:
    expected = "answerable" if q.answerable else "not answerable from the corpus"
    print(f"Q {q.qid}: {q.question}  [{expected}]")
    verdict = "ABSTAINED" if crag["abstained"] else "answered"
    top = crag["top_score"]
    print(f"  action: {crag['action']}  top score: {top if top is not None else '-'}  {verdict}")
    explained = [n for n in crag["nodes"] if n.get("explanation") and "contributions" in n["explanation"]]
    if explained:
        best = max(explained, key=lambda n: n["score"])
        why = best["explanation"]
        parts = sorted(why["contributions"].items(), key=lambda kv: -abs(kv[1]))[:3]
        print(
            f"  best candidate {best['doc_id'] or best['node_id']} ({best['score']}): "
            + ", ".join(f"{name} {value:+.2f}" for name, value in parts)
            + f"; lacks: {', '.join(why['missing_terms'][:5]) or 'nothing'}"
        )
    if crag.get("rewritten_query"):
        print(
            f"  rewritten query ({crag['rewrite_source']}): {crag['rewritten_query']}  "
            f"fallback: {', '.join(crag['fallback_sources']) or '-'}"
        )
    check = crag.get("answer_check") or {}
    if check and crag["answered_by"] != "generate":
        print(f"  the generated answer's check: {_described_check(check)}")
    if crag["abstained"]:
        print(f"  why: {crag['abstain_reason']}")
    if crag["answered_by"] == "extract":
        print("  answer (quoted):")
        for quote in crag["quotes"]:
            print(f'    "{" ".join(quote["text"].split())[:300]}" ({quote["source"]})')
    elif crag["answered_by"] == "generate":
        label = "generated" if not check else f"generated, {_described_check(check)}"
        print(f"  answer ({label}): {' '.join(answer.split())[:300]}")
    else:
        print(f"  answer: {' '.join(answer.split())[:300]}")
    print(f"  sources: {', '.join(sources) or '-'}   crag_ms: {crag['timings_ms']['crag_ms']:.0f}\n")


def _described_check(check: dict) -> str:
    """One line on an answer's check: supported, or what was not, or why it could not be checked."""
    if check.get("grounded"):
        return "supported by its sources"
    if check.get("grounded") is None:
        return f"NOT CHECKED ({check.get('reason')})"
    unsupported = ", ".join(check.get("unsupported", [])[:6])
    return f"NOT SUPPORTED by its sources ({unsupported or check.get('reason')})"


def _print_summary(rows: List[dict]) -> None:
    actions = {a: sum(1 for r in rows if r["action"] == a) for a in ("correct", "ambiguous", "incorrect", "disabled")}
    abstained = sum(1 for r in rows if r["abstained"])
    shares = ", ".join(f"{a} {n}" for a, n in actions.items() if n)
    quoted = sum(1 for r in rows if r["answered_by"] == "extract")
    generated = [r for r in rows if r["answered_by"] == "generate"]
    flagged = sum(1 for r in generated if r.get("grounded") is not True and r.get("answer_check"))
    print(
        f"Summary: {len(rows)} questions; actions: {shares}; abstained on {abstained}; "
        f"answered by quoting {quoted}, by generating {len(generated)} ({flagged} flagged as not supported)."
    )


def _targets(args: argparse.Namespace) -> dict:
    return {"target_precision": args.target_precision, "target_recall": args.target_recall}


def _calibrate(args: argparse.Namespace) -> int:
    from llama_index_crag.calibration.report import run_calibration

    data = run_calibration(
        Path(args.dataset),
        args.scorer,
        Path(args.out),
        args.k,
        args.limit,
        args.split,
        _targets(args),
        args.progress,
        args.strip_min_tokens,
        args.synthetic,
    )
    t, a = data["thresholds"], data["achieved"]
    print(f"Scorer {data['scorer']}: upper={t['upper']:.4f} lower={t['lower']:.4f}")
    if "strip_threshold" in t:
        print(
            f"Knowledge strips: threshold {t['strip_threshold']:.4f} keeps {data['strips']['evidence_kept']:.3f} of "
            f"evidence strips and drops {data['strips']['other_dropped']:.3f} of the others "
            f"(strips of {data['strips']['passages']} gold passages)."
        )
    print(
        f"Achieved on {sum(data['samples'].values())} batches {data['samples']}: precision of CORRECT "
        f"{a['precision_correct']:.3f}, recall of INCORRECT {a['recall_incorrect']:.3f}. Wrote {args.out}."
    )
    return 0


def _grade_report(args: argparse.Namespace) -> int:
    from llama_index_crag.calibration.report import run_report, table

    report = run_report(
        Path(args.dataset),
        [s.strip() for s in args.scorers.split(",") if s.strip()],
        Path(args.calibration) if args.calibration else None,
        Path(args.out),
        args.k,
        args.folds,
        args.limit,
        args.judge_limit,
        _targets(args),
        args.strip_min_tokens,
        args.progress,
    )
    print(f"{report['dataset']} ({report['protocol']}, top-{report['k']} candidates)\n")
    print(table(report["results"]))
    print(
        "\nceiling: the best three-band accuracy any single lower threshold reaches on these scores, "
        "chosen on the same rows (a bound, not a result)"
    )
    for result in report["results"]:
        if result.get("strips"):
            s = result["strips"]
            print(
                f"\nStrips ({result['scorer']}, threshold {s['strip_threshold_mean']:.3f}): evidence strips kept "
                f"{s['evidence_kept']:.3f} of {s['evidence_strips']}, other strips dropped {s['other_dropped']:.3f} "
                f"of {s['other_strips']}"
            )
            if s.get("at_lower"):
                low = s["at_lower"]
                print(
                    f"  at the passage threshold lower instead: kept {low['evidence_kept']:.3f}, "
                    f"dropped {low['other_dropped']:.3f}"
                )
    print(f"\nWrote {args.out}/grade-report.json, .md and .png")
    return 0


def _grade_pairs(args: argparse.Namespace) -> int:
    import json

    from tqdm import tqdm

    from llama_index_crag.calibration.pair_report import held_out_rows, pair_figures, pair_table
    from llama_index_crag.scorers.registry import report_scorers

    rows = held_out_rows(args.pairs_file, limit=args.limit)
    corpus = list(dict.fromkeys(r["passage"] for r in rows))
    results = []
    for name, scorer in report_scorers([s.strip() for s in args.scorers.split(",") if s.strip()], corpus):
        desc = scorer.name[:40]
        bar = (lambda it, d=desc: tqdm(it, total=len(rows), desc=d)) if args.progress else iter
        result = pair_figures(scorer, rows, folds=args.folds, progress=bar)
        result["default"] = name == "default"
        results.append(result)
    print(f"{args.pairs_file}: {len(rows)} held-out pairs ({results[0]['protocol']})\n")
    print(pair_table(results))
    if args.out:
        Path(args.out).write_text(json.dumps({"pairs_file": str(args.pairs_file), "results": results}, indent=2) + "\n")
        print(f"\nWrote {args.out}")
    return 0


def _pack_grader(args: argparse.Namespace) -> int:
    from llama_index_crag.calibration.packaging import pack_grader

    notice = Path(args.notice).read_text(encoding="utf-8") if args.notice else None
    packed = pack_grader(args.grader, args.out, args.calibration, quantize=args.int8, notice=notice)
    size = sum(f.stat().st_size for f in Path(args.out).iterdir()) / 1e6
    print(
        f"Packed {args.grader} into {args.out} ({size:.1f} MB, float16 weights, "
        f"{'int8' if packed['quantize'] else 'float32'} inference"
        f"{', stacked model and thresholds from ' + str(args.calibration) if args.calibration else ''})"
    )
    return 0


def _train_grader(args: argparse.Namespace) -> int:
    from llama_index_crag.calibration.labelled import load_labelled_pairs
    from llama_index_crag.calibration.pairs import make_pairs
    from llama_index_crag.calibration.training import PairSet, TrainingConfig, train_grader

    if not args.corpus and not args.pairs_file:
        raise ValueError("train-grader needs --pairs-file FILE (labelled pairs), --corpus DIR (pairs from it), or both")
    sets = []
    if args.pairs_file:
        sets.append(load_labelled_pairs(args.pairs_file, seed=args.seed))
    if args.corpus:
        sets.append(
            make_pairs(args.corpus, count=args.pairs, claims=args.claims, seed=args.seed, progress=args.progress)
        )
    pairs = PairSet([p for s in sets for p in s.train], [p for s in sets for p in s.held_out])
    counts = pairs.counts()
    source = " and ".join(str(s) for s in (args.pairs_file, args.corpus) if s)
    print(
        f"Pairs from {source}: {len(pairs.train)} to train on {counts['train']}, "
        f"{len(pairs.held_out)} held out (other documents and questions) {counts['held_out']}."
    )
    config = TrainingConfig(
        max_length=args.max_length,
        batch_size=args.batch_size,
        learning_rate=args.lr,
        epochs=args.epochs,
        train_layers=args.train_layers,
        minutes=args.minutes,
        seed=args.seed,
        threads=args.threads,
        device=args.device,
    )
    info = train_grader(pairs, Path(args.out), config=config, progress=args.progress, corpus=source)
    print(
        f"Reader trained {info['steps']} of {info['total_steps']} steps in {info['minutes']:.1f} min "
        f"({info['stopped']}): held-out AUROC {info['history'][0]['held_out_auroc']:.3f} untrained -> "
        f"{info['held_out_auroc']:.3f} (int8: {info['held_out_auroc_int8']:.3f}). Wrote {args.out}."
    )
    if info["held_out_auroc"] < 0.9 and info["stopped"] == "finished" and not args.pairs_file:
        print("Held-out AUROC below 0.9 on synthetic pairs: the pairs are too hard or noisy for this corpus.")
    print(f"Use it: llama-crag calibrate --scorer reader:{args.out} ..., or CRAG_GRADER={args.out}")
    return 0


def _add_dataset_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", required=True, help="folder with corpus.jsonl and questions.jsonl")
    parser.add_argument("--k", type=int, default=5, help="candidates retrieved per question")
    parser.add_argument("--limit", type=int, default=None, help="use only the first N questions")
    parser.add_argument("--target-precision", type=float, default=0.9, help="precision wanted of CORRECT")
    parser.add_argument("--target-recall", type=float, default=0.9, help="share of out-of-corpus batches to catch")
    parser.add_argument("--strip-min-tokens", type=int, default=8, help="knowledge-strip size, as in the engine")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="hide progress bars")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``llama-crag``."""
    parser = argparse.ArgumentParser(prog="llama-crag", description="Corrective RAG for LlamaIndex.")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="answer the sample questions over the bundled sample corpus")
    demo.add_argument("--dataset", default=str(SAMPLE_DIR), help="folder with corpus.jsonl and questions.jsonl")
    demo.add_argument("--limit", type=int, default=None, help="ask only the first N questions")
    demo.add_argument("--ollama-url", default=DEFAULT_OLLAMA_URL, help="Ollama server to try first")
    demo.add_argument("--ollama-model", default=DEFAULT_OLLAMA_MODEL, help="Ollama model to use when it answers")
    demo.add_argument(
        "--generate",
        action="store_true",
        help="generate the answers (Ollama if it answers, else the bundled SmolLM2 in llama.cpp) instead of quoting",
    )
    demo.add_argument("--gguf", default=None, help="a GGUF model file for llama.cpp instead of the bundled SmolLM2")
    demo.add_argument("--calibration", default=None, help="calibration JSON with the thresholds")
    demo.add_argument(
        "--disable-crag", action="store_true", help="plain retrieve-then-generate, for comparison (implies --generate)"
    )
    demo.add_argument("--json", action="store_true", help="print every trace as JSON")
    demo.add_argument(
        "--explain", action="store_true", help="show why the best candidate scored what it did (as CRAG_EXPLAIN=true)"
    )
    demo.add_argument("--progress", action="store_true", help="show a progress bar over the questions")
    demo.set_defaults(run=_demo)

    doctor = commands.add_parser(
        "doctor",
        help="check what the engine will use on this machine (torch, embeddings, Ollama, llama.cpp, spaCy)",
        description="Loads and runs each part for real, times it, and prints the fix for what fails. "
        "Exits 1 when a part the demo needs fails.",
    )
    doctor.add_argument("--ollama-url", default=DEFAULT_OLLAMA_URL, help="Ollama server to try")
    doctor.add_argument("--ollama-model", default=DEFAULT_OLLAMA_MODEL, help="Ollama model to look for")
    doctor.add_argument("--gguf", default=None, help="check this GGUF instead of the bundled SmolLM2")
    doctor.add_argument("--json", action="store_true", help="print the checks as JSON")
    doctor.set_defaults(run=_doctor)

    calibrate = commands.add_parser("calibrate", help="fit the thresholds (and learned weights) on a labelled set")
    _add_dataset_options(calibrate)
    calibrate.add_argument("--scorer", default="evidence", help="evidence, bi-encoder, llm-judge, cross-encoder:MODEL")
    calibrate.add_argument("--split", default=None, help="fit only on questions of this split (e.g. train)")
    calibrate.add_argument(
        "--synthetic",
        type=int,
        default=None,
        metavar="N",
        help="no labels needed: make N questions from the corpus's own sentences (named dates, people, numbers...) "
        "and fit on them; questions.jsonl is not read",
    )
    calibrate.add_argument("--out", default="calibration.json", help="where to write the calibration file")
    calibrate.set_defaults(run=_calibrate)

    train = commands.add_parser(
        "train-grader",
        help="train a reading grader (a cross-encoder) on CPU from your corpus alone",
        description="Reads labelled question-passage pairs (--pairs-file) and/or makes pairs from a corpus (hard "
        "negatives included), fine-tunes the bundled MiniLM on them under a time budget, keeps the best "
        "checkpoint by held-out AUROC, and writes a grader directory for calibrate --scorer reader:DIR or "
        "CRAG_GRADER. Run it again to resume.",
    )
    train.add_argument(
        "--pairs-file",
        default=None,
        metavar="FILE",
        help="labelled pairs, one JSON object a line: question, passage, label (1 answers), optional source, "
        "kind, title; a tenth of each source is held out by article or question",
    )
    train.add_argument(
        "--corpus", default=None, help="folder with corpus.jsonl: pairs made from it (mixed in with --pairs-file)"
    )
    train.add_argument("--out", required=True, help="the grader directory to write (and resume from)")
    train.add_argument("--minutes", type=float, default=40.0, help="hard time budget for training")
    train.add_argument("--pairs", type=int, default=20_000, help="pairs to make from --corpus (about a third positive)")
    train.add_argument(
        "--claims", type=float, default=0.15, help="share of questions made as claims (raise it if users type claims)"
    )
    train.add_argument("--epochs", type=float, default=1.0, help="passes over the training pairs")
    train.add_argument("--max-length", type=int, default=128, help="tokens of question and passage together")
    train.add_argument("--batch-size", type=int, default=16, help="pairs a step")
    train.add_argument("--lr", type=float, default=5e-5, help="peak encoder learning rate (warm-up, decay)")
    train.add_argument("--train-layers", type=int, default=6, help="top encoder layers trained (6: all of MiniLM)")
    train.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    train.add_argument("--seed", type=int, default=0, help="seed for pairs, order and initialisation")
    train.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU (inference stays on CPU)")
    train.add_argument("--no-progress", dest="progress", action="store_false", help="hide progress bars")
    train.set_defaults(run=_train_grader)

    report = commands.add_parser("grade-report", help="measure the grader alone, out of sample")
    _add_dataset_options(report)
    report.add_argument("--scorers", default="evidence,bi-encoder", help="comma-separated scorers to compare")
    report.add_argument("--calibration", default=None, help="use this file's thresholds on the rows it was not fit on")
    report.add_argument("--folds", type=int, default=5, help="cross-validation folds when no calibration is given")
    report.add_argument("--judge-limit", type=int, default=40, help="batches the (slow) LLM judge grades")
    report.add_argument("--out", default="grade-report", help="folder for the JSON, Markdown and PNG")
    report.set_defaults(run=_grade_report)
    pairs = commands.add_parser(
        "grade-pairs",
        help="measure the grader on labelled pairs held out from training (the split train-grader uses)",
    )
    pairs.add_argument("--pairs-file", required=True, help="JSONL of question, passage, label (source, title)")
    pairs.add_argument("--scorers", default="evidence,reader", help="comma-separated scorers (default comes first)")
    pairs.add_argument("--folds", type=int, default=5, help="cross-validation folds for fitted scorers")
    pairs.add_argument("--limit", type=int, default=None, help="a sample of N held-out pairs")
    pairs.add_argument("--out", default=None, help="also write the figures to this JSON file")
    pairs.add_argument("--no-progress", dest="progress", action="store_false", help="hide progress bars")
    pairs.set_defaults(run=_grade_pairs)
    pack = commands.add_parser(
        "pack-grader", help="make a trained grader directory shippable (float16, checksummed, stacked model inside)"
    )
    pack.add_argument("--grader", required=True, help="a directory written by llama-crag train-grader")
    pack.add_argument("--out", required=True, help="the packed grader directory to write")
    pack.add_argument("--calibration", default=None, help="calibrate --scorer reader:DIR output to carry inside")
    pack.add_argument("--int8", action="store_true", help="score with the int8-quantised encoder (faster, less exact)")
    pack.add_argument("--notice", default=None, help="a NOTICE file (the training data's licence) to ship beside it")
    pack.set_defaults(run=_pack_grader)
    snippets = commands.add_parser(
        "snippets",
        help="derive a noisy on-topic snippet set from a dataset (the grader's hardest case) for grade-report",
        description="Cuts every document into snippets of a few sentences and relabels each question by the "
        "snippets that hold its answer (answer string or evidence sentence). Out of corpus, retrieval then finds "
        "the rest of the same document: on the subject, without the answer.",
    )
    snippets.add_argument("--dataset", required=True, help="folder with corpus.jsonl and questions.jsonl")
    snippets.add_argument("--out", required=True, help="folder for the derived corpus.jsonl and questions.jsonl")
    snippets.add_argument("--min-words", type=int, default=30, help="shortest snippet in words")
    snippets.set_defaults(run=_snippets)
    ingest = commands.add_parser(
        "ingest",
        help="build or update a persisted index folder from a folder of documents (for llama-crag serve)",
        description="Reads DOCS_DIR (a corpus.jsonl in the shared dataset format, or .txt/.md/.rst/.html/.csv/.json "
        "files), chunks and embeds it, and writes the vector index, the chunks for the BM25 and sentence-window "
        "fallback, their embeddings, the evidence scorer's corpus statistics, and the calibration and grader it "
        "is built with. Run it again on a changed folder: only added or changed documents are embedded, vanished "
        "ones are removed.",
    )
    ingest.add_argument("docs", metavar="DOCS_DIR", help="folder of documents")
    ingest.add_argument("--out", metavar="INDEX_DIR", help="the index folder to write or update")
    ingest.add_argument(
        "--store", metavar="URL", help="write into PostgreSQL with pgvector instead (postgresql://user@host/db)"
    )
    ingest.add_argument("--table", default="crag", help="the store's name in PostgreSQL (with --store)")
    ingest.add_argument(
        "--index-precision",
        choices=("full", "half"),
        default=None,
        help="with --store, a new store's HNSW indexes over full vectors or halfvec casts (half the index memory)",
    )
    ingest.add_argument("--calibration", default=None, help="a calibration file to serve with (llama-crag calibrate)")
    ingest.add_argument("--grader", default=None, help="a grader directory to serve with (llama-crag train-grader)")
    ingest.add_argument("--no-warm", dest="warm", action="store_false", help="do not embed the sentence windows now")
    ingest.set_defaults(run=_ingest)

    serve = commands.add_parser(
        "serve",
        help="serve an index folder: query API, OpenAI-compatible chat API, metrics and the decision-trace console",
        description="Binds to 127.0.0.1 unless --host says otherwise. Set CRAG_API_KEY to require a key on every "
        "route but /healthz.",
    )
    serve.add_argument("--index", default="", help="index folder written by llama-crag ingest")
    serve.add_argument("--store", default=None, metavar="URL", help="serve a PostgreSQL store instead (ingest --store)")
    serve.add_argument("--table", default="crag", help="the store's name in PostgreSQL (with --store)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000, help="port to bind")
    serve.add_argument("--workers", type=int, default=1, help="worker processes over the same index folder")
    serve.add_argument(
        "--llm",
        choices=("auto", "ollama", "llamacpp", "none"),
        default="auto",
        help="auto: Ollama if it answers, else the bundled GGUF in llama.cpp; none: retrieval and grading only",
    )
    serve.add_argument("--model", default=None, help=f"Ollama model (default {DEFAULT_OLLAMA_MODEL})")
    serve.add_argument("--ollama-url", default=None, help=f"Ollama server (default {DEFAULT_OLLAMA_URL})")
    serve.add_argument("--gguf", default=None, help="a GGUF file for --llm llamacpp instead of the bundled SmolLM2")
    serve.add_argument("--disable-crag", action="store_true", help="plain retrieve-then-generate, for comparison")
    serve.add_argument("--cors-origin", action="append", default=[], help="allow this browser origin (repeatable)")
    serve.add_argument("--max-body-bytes", type=int, default=64 * 1024, help="largest request body accepted")
    serve.add_argument("--max-query-chars", type=int, default=4000, help="longest query accepted")
    serve.add_argument(
        "--query-timeout", type=float, default=120.0, help="seconds a query may take before it is cut off"
    )
    serve.add_argument(
        "--rate-window", type=float, default=300.0, help="seconds behind crag_fallback_rate and crag_refusal_rate"
    )
    serve.add_argument("--log-level", default="info", help="uvicorn's log level")
    serve.set_defaults(run=_serve)
    add_eval_parser(commands)
    return parser


def _ingest(args: argparse.Namespace) -> int:
    from llama_index_crag.stores.folder import ingest

    if bool(args.out) == bool(args.store):
        raise SystemExit("llama-crag ingest: give either --out INDEX_DIR or --store postgresql://...")
    if args.store:
        from llama_index_crag.stores.postgres import PostgresStore
        from llama_index_crag.stores.postgres import ingest as ingest_store

        store = PostgresStore(args.store, table=args.table, index_precision=args.index_precision)
        stored = ingest_store(args.docs, store, progress=True)
        print(stored.summary() + f" in {stored.seconds:.1f} s")
        print(f"Serve it: llama-crag serve --store URL --table {args.table}")
        return 0
    report = ingest(
        args.docs, args.out, calibration=args.calibration, grader=args.grader, warm_fallback=args.warm, progress=True
    )
    print(report.summary() + f" in {report.seconds:.1f} s")
    for skipped in report.skipped:
        print(f"  skipped {skipped}")
    print(f"Serve it: llama-crag serve --index {args.out}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from llama_index_crag.server import require_extra

    try:
        require_extra()
    except ImportError as exc:
        raise SystemExit(f"llama-crag serve: {exc}") from None
    from llama_index_crag.server.main import ServeOptions, serve

    if bool(args.index) == bool(args.store):
        raise SystemExit("llama-crag serve: give either --index INDEX_DIR or --store postgresql://...")
    serve(
        ServeOptions(
            index=args.index,
            store=args.store,
            table=args.table,
            host=args.host,
            port=args.port,
            workers=args.workers,
            llm=args.llm,
            model=args.model,
            ollama_url=args.ollama_url,
            gguf=args.gguf,
            disable_crag=args.disable_crag,
            cors_origins=args.cors_origin,
            max_body_bytes=args.max_body_bytes,
            max_query_chars=args.max_query_chars,
            query_timeout_s=args.query_timeout,
            rate_window_s=args.rate_window,
            log_level=args.log_level,
        )
    )
    return 0


def _snippets(args: argparse.Namespace) -> int:
    from llama_index_crag.evaluation.snippets import snippet_set

    counts = snippet_set(Path(args.dataset), Path(args.out), args.min_words)
    print(
        f"Wrote {counts['snippets']} snippets and {counts['questions']} questions to {args.out} "
        f"({counts['left_out']} answerable questions left out: no snippet holds their answer)."
    )
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``llama-crag``."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except (ValueError, FileNotFoundError, GeneratorUnavailable) as exc:
        print(f"llama-crag: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
