"""``llama-crag`` commands that build and measure a grader: calibrate, train-grader, pack-grader, grade-report,
grade-pairs, and snippets (the hardest test set for grade-report)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tqdm import tqdm

from llama_index_crag.arguments import at_least, positive_int
from llama_index_crag.errors import ConfigError
from llama_index_crag.scorers.reader_model import POOLINGS


def add_parsers(commands: Any) -> None:
    """Add the grading commands to ``llama-crag``'s subparsers."""
    calibrate = commands.add_parser(
        "calibrate",
        help="fit the thresholds (and learned weights) on a labelled set, or on an index folder's own chunks",
        description="Fits the grader's thresholds (and the evidence scorer's weights) for one scorer and one "
        "embedding model, on a labelled set (--dataset), on questions made from a corpus (--synthetic N), or on "
        "questions made from an index folder's chunks (--index INDEX_DIR --synthetic N: the step after llama-crag "
        "ingest; the file is stored with the index, and the engine over it grades with it).",
    )
    _add_dataset_options(calibrate, several=True, required=False)
    calibrate.add_argument(
        "--index",
        metavar="INDEX_DIR",
        default=None,
        help="an index folder written by llama-crag ingest (instead of --dataset, with --synthetic N): its chunks "
        "are the corpus, its embedding model retrieves, and the calibration is stored in it unless --out names "
        "another file",
    )
    calibrate.add_argument(
        "--embed-model",
        metavar="NAME_OR_PATH",
        default=None,
        help="the embedding model the engine will embed with: a sentence-transformers model's folder, or its "
        "Hugging Face name when it is in this machine's cache (nothing is downloaded); default: the bundled "
        "all-MiniLM-L6-v2, or with --index the index's own model",
    )
    calibrate.add_argument(
        "--scorer",
        default=None,
        help="evidence, bi-encoder, llm-judge, cross-encoder:MODEL, reader:DIR, packaged; default: evidence, or with "
        "--index the grader the engine over the index uses",
    )
    calibrate.add_argument(
        "--synthetic",
        type=positive_int,
        default=None,
        metavar="N",
        help="no labels needed: make N questions from the corpus's own sentences (named dates, people, numbers...) "
        "and fit on them; questions.jsonl is not read",
    )
    calibrate.add_argument(
        "--out",
        default=None,
        help="where to write the calibration file (default: calibration.json); with --index and no --out, into the "
        "index folder, where the engine over it finds it",
    )
    calibrate.add_argument(
        "--reset",
        action="store_true",
        help="with --index: forget the calibration stored in the index, so that the engine over it grades with the "
        "scorer's shipped thresholds again",
    )
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
    train.add_argument(
        "--lr",
        type=float,
        default=None,
        help="peak encoder learning rate (warm-up, decay; default 5e-5, or 5e-4 with --lora-rank)",
    )
    train.add_argument("--train-layers", type=int, default=6, help="top encoder layers trained (6: all of MiniLM)")
    train.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help="stop after this step of the --epochs schedule (to compare settings at equal steps); run again to go on",
    )
    train.add_argument(
        "--pooling", choices=POOLINGS, default="mean", help="token states to the head: their mean, or [CLS]'s"
    )
    train.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="train a LoRA adapter of this rank on every layer instead of the top --train-layers (needs peft: "
        "pip install 'llama-index-crag[train]'); what is saved is the adapter and head, under a megabyte",
    )
    train.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="torch threads (default: OMP_NUM_THREADS, else the cores this process may use)",
    )
    train.add_argument("--seed", type=int, default=0, help="seed for pairs, order and initialisation")
    train.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU (inference stays on CPU)")
    train.add_argument("--no-progress", dest="progress", action="store_false", help="hide progress bars")
    train.set_defaults(run=_train_grader)

    answers = commands.add_parser(
        "train-answers",
        help="train the answer step's network (which sentences answer) on labelled sentence pairs",
        description="Reads labelled question-sentence pairs, computes the answer model's features (the evidence "
        "scorer's, the kind of answer, figures and names), trains a small network on nine tenths of each source "
        "(held out by article or question), and a second one, the ranker, that also reads how each sentence leads "
        "the other sentences of its question; prints the held-out AUROC by source and how often the first "
        "sentence answers, by probability and by the ranking, and writes both to --out. Use it with "
        "CRAG_ANSWER_MODEL=DIR.",
    )
    answers.add_argument("--pairs-file", required=True, help="JSONL of question, passage, label (source, kind, title)")
    answers.add_argument("--out", required=True, help="the folder to write the network to")
    answers.add_argument(
        "--threshold", type=float, default=0.5, help="the probability at which a strip is quoted, whatever its grade"
    )
    answers.add_argument("--no-progress", dest="progress", action="store_false", help="hide progress bars")
    answers.set_defaults(run=_train_answers)

    report = commands.add_parser("grade-report", help="measure the grader alone, out of sample")
    _add_dataset_options(report)
    report.add_argument("--scorers", default="evidence,bi-encoder", help="comma-separated scorers to compare")
    report.add_argument("--calibration", default=None, help="use this file's thresholds on the rows it was not fit on")
    report.add_argument(
        "--folds", type=at_least(2), default=5, help="cross-validation folds when no calibration is given"
    )
    report.add_argument("--judge-limit", type=at_least(0), default=40, help="batches the (slow) LLM judge grades")
    report.add_argument("--out", default="grade-report", help="folder for the JSON, Markdown and PNG")
    report.add_argument(
        "--best-sentence",
        action="store_true",
        help="also measure the answer model's best-strip probability as a grader feature (reads every strip)",
    )
    report.set_defaults(run=_grade_report)
    pairs = commands.add_parser(
        "grade-pairs",
        help="measure the grader on labelled pairs held out from training (the split train-grader uses)",
    )
    pairs.add_argument("--pairs-file", required=True, help="JSONL of question, passage, label (source, title)")
    pairs.add_argument("--scorers", default="evidence,reader", help="comma-separated scorers (default comes first)")
    pairs.add_argument("--folds", type=at_least(2), default=5, help="cross-validation folds for fitted scorers")
    pairs.add_argument("--limit", type=positive_int, default=None, help="a sample of N held-out pairs")
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


def _add_dataset_options(parser: argparse.ArgumentParser, several: bool = False, required: bool = True) -> None:
    if several:
        parser.add_argument(
            "--dataset",
            required=required,
            action="append",
            help="folder with corpus.jsonl and questions.jsonl; give it again to fit one calibration on several "
            "sets, each counting the same",
        )
    else:
        parser.add_argument("--dataset", required=True, help="folder with corpus.jsonl and questions.jsonl")
    parser.add_argument("--k", type=positive_int, default=5, help="candidates retrieved per question")
    parser.add_argument("--limit", type=positive_int, default=None, help="use only the first N questions")
    parser.add_argument(
        "--split",
        default="all",
        help="design or check: one half of the set, cut by document so that a question and its passages stay "
        "together (fit on design, report check); all: the whole set; another name: the questions whose own 'split' "
        "field has it",
    )
    parser.add_argument("--target-precision", type=float, default=0.9, help="precision wanted of CORRECT")
    parser.add_argument("--target-recall", type=float, default=0.9, help="share of out-of-corpus batches to catch")
    parser.add_argument(
        "--max-false-reject",
        type=float,
        default=None,
        metavar="SHARE",
        help="hold lower so that at most this share of the batches with the answer grade INCORRECT (a cap on false "
        "abstention that wins over --target-recall), e.g. 0.03",
    )
    parser.add_argument(
        "--strip-min-tokens", type=positive_int, default=8, help="knowledge-strip size, as in the engine"
    )
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="hide progress bars")


def _targets(args: argparse.Namespace) -> dict:
    targets = {"target_precision": args.target_precision, "target_recall": args.target_recall}
    for option, share in (("--target-precision", args.target_precision), ("--target-recall", args.target_recall)):
        if not 0.0 < share <= 1.0:  # a precision of 1.5 is met by no threshold, and the file would not say so
            raise ConfigError(f"{option} is a share: more than 0 and at most 1, got {share}")
    if args.max_false_reject is not None:
        if not 0.0 <= args.max_false_reject < 1.0:
            raise ConfigError(f"--max-false-reject must be at least 0 and below 1, got {args.max_false_reject}")
        targets["max_false_reject"] = args.max_false_reject
    return targets


def _calibrate(args: argparse.Namespace) -> int:
    from llama_index_crag.calibration.calibrate import run_calibration
    from llama_index_crag.local.models import load_embed_model

    if args.index and args.dataset:
        raise ConfigError("calibrate reads --dataset DIR or --index INDEX_DIR, not both: name one")
    if not args.index and not args.dataset:
        raise ConfigError(
            "calibrate needs --dataset DIR (labelled questions, or a corpus with --synthetic N) or --index INDEX_DIR "
            "--synthetic N (an index folder written by llama-crag ingest)"
        )
    if args.out and Path(args.out).is_dir():  # found before the fit, not when its result is written
        raise ConfigError(f"--out {args.out} is a folder: name the calibration file to write")
    if args.reset:
        return _reset_index_calibration(args)
    if args.index:
        return _calibrate_index(args)
    out = Path(args.out or "calibration.json")
    data = run_calibration(
        [Path(d) for d in args.dataset],
        args.scorer or "evidence",
        out,
        args.k,
        args.limit,
        args.split,
        _targets(args),
        args.progress,
        args.strip_min_tokens,
        args.synthetic,
        load_embed_model(args.embed_model) if args.embed_model else None,
    )
    _report_calibration(data, out)
    return 0


def _calibrate_index(args: argparse.Namespace) -> int:
    """``calibrate --index``: synthetic questions over an index folder's chunks, the file stored in the folder."""
    from llama_index_crag.calibration.calibrate import calibrate_index
    from llama_index_crag.core.persisted import index_scorer
    from llama_index_crag.local.models import load_embed_model
    from llama_index_crag.scorers.bi_encoder import BUNDLED_MODEL_NAME
    from llama_index_crag.scorers.registry import check_spec, from_spec
    from llama_index_crag.settings_sources import same_embed_model
    from llama_index_crag.stores.folder import CALIBRATION, index_embed_model, load_index, record_calibration

    if args.synthetic is None:
        raise ConfigError(
            f"--index fits on questions made from the index's chunks: add --synthetic N (300 is a good start), e.g. "
            f"llama-crag calibrate --index {args.index} --synthetic 300"
        )
    if args.limit is not None or args.split != "all":
        raise ConfigError(
            "--limit and --split choose questions of a --dataset; with --index, --synthetic N says how many"
        )
    embedded_with = index_embed_model(args.index)
    model = load_embed_model(args.embed_model or embedded_with)
    if not same_embed_model(model.model_name, embedded_with):
        raise ConfigError(
            f"{args.index} was embedded with {embedded_with}, not {args.embed_model}: the engine over it searches "
            f"with that model, so calibrate for it (drop --embed-model), or ingest the documents into another folder "
            f"with {args.embed_model} (stores.folder.ingest(..., embed_model=)) and calibrate that one"
        )
    loaded = load_index(args.index, model)
    into_index = not args.out
    if into_index and args.scorer is not None:
        engine = index_scorer(loaded).name
        spec = check_spec(args.scorer)
        given = from_spec(spec, loaded.embed_model).name if spec.partition(":")[0] in _INDEX_SCORERS else spec
        if given != engine:
            raise ConfigError(
                f"the engine over {args.index} grades with {engine}, not {given}: drop --scorer to calibrate the "
                "index's own grader, or write this calibration elsewhere with --out FILE"
            )
    out = loaded.index_dir / CALIBRATION if into_index else Path(args.out)
    data = calibrate_index(
        loaded, args.synthetic, out, args.scorer, args.k, _targets(args), args.progress, args.strip_min_tokens
    )
    if into_index:
        record_calibration(loaded.index_dir)
    _report_calibration(data, out)
    if into_index:
        print(f"Stored with the index: the engine over {args.index} (llama-crag serve --index, load_engine) uses it.")
    if data.get("embed_model") == BUNDLED_MODEL_NAME:  # the file names the bundled model so, however loaded
        print(
            f"Note: {BUNDLED_MODEL_NAME} ships with a calibration fitted on human-written questions. Questions made "
            "from your chunks copy their words and fit stricter thresholds, which abstain on questions phrased as "
            "people phrase them (on a manual's pages, most answerable ones: docs/grading.md, \"On a manual's "
            'pages"). Measure both on questions of your own (llama-crag eval-docs --index); to go back: llama-crag '
            f"calibrate --index {args.index} --reset"
        )
    return 0


def _reset_index_calibration(args: argparse.Namespace) -> int:
    """``calibrate --index DIR --reset``: the index forgets its stored calibration."""
    from llama_index_crag.stores.folder import forget_calibration

    if not args.index:
        raise ConfigError("--reset forgets an index folder's calibration: name it with --index INDEX_DIR")
    if args.dataset or args.synthetic is not None or args.out or args.scorer or args.embed_model:
        raise ConfigError("--reset fits nothing: give it --index INDEX_DIR alone")
    forgotten = forget_calibration(args.index)
    if forgotten:
        print(f"Removed {forgotten} from {args.index}: the engine over it grades with the scorer's shipped thresholds.")
    else:
        print(f"{args.index} holds no calibration: the engine over it grades with the scorer's shipped thresholds.")
    return 0


#: The scorers an engine over an index folder may grade with (``load_engine``: the evidence features, or a reader
#: behind them); another spec is named as given.
_INDEX_SCORERS = ("default", "evidence", "packaged", "reader")


def _report_calibration(data: dict, out: Path) -> None:
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
        f"{a['precision_correct']:.3f}, recall of INCORRECT {a['recall_incorrect']:.3f}, batches with the answer "
        f"graded INCORRECT {a.get('false_reject', 0.0):.3f}. Wrote {out}."
    )


def _train_grader(args: argparse.Namespace) -> int:
    from llama_index_crag.calibration.labelled import load_labelled_pairs
    from llama_index_crag.calibration.pairs import make_pairs
    from llama_index_crag.calibration.training import PairSet, TrainingConfig, default_learning_rate, train_grader

    if not args.corpus and not args.pairs_file:
        raise ConfigError(
            "train-grader needs --pairs-file FILE (labelled pairs), --corpus DIR (pairs from it), or both"
        )
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
        learning_rate=args.lr if args.lr is not None else default_learning_rate(args.lora_rank),
        epochs=args.epochs,
        train_layers=args.train_layers,
        minutes=args.minutes,
        max_steps=args.max_steps,
        pooling=args.pooling,
        lora_rank=args.lora_rank,
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
    by_source = ", ".join(f"{k} {v:.3f}" for k, v in info["held_out_auroc_by_source"].items())
    print(f"Held-out AUROC by source: {by_source}.")
    if info["held_out_auroc"] < 0.9 and info["stopped"] == "finished" and not args.pairs_file:
        print("Held-out AUROC below 0.9 on synthetic pairs: the pairs are too hard or noisy for this corpus.")
    print(f"Use it: llama-crag calibrate --scorer reader:{args.out} ..., or CRAG_GRADER={args.out}")
    return 0


def _train_answers(args: argparse.Namespace) -> int:
    from llama_index_crag.calibration.answer_training import summary, train_answer_model

    if not 0.0 <= args.threshold <= 1.0:
        raise ConfigError(f"--threshold is a probability, from 0 to 1, got {args.threshold}")
    info = train_answer_model(args.pairs_file, args.out, progress=args.progress, threshold=args.threshold)
    print(summary(info))
    print(f"Wrote {args.out}. Use it: CRAG_ANSWER_MODEL={args.out}")
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


def _grade_report(args: argparse.Namespace) -> int:
    from llama_index_crag.calibration.report import run_report
    from llama_index_crag.calibration.report_figures import legend, table

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
        args.split,
        args.best_sentence,
    )
    half = "" if args.split == "all" else f", {args.split} half"
    print(f"{report['dataset']} ({report['protocol']}{half}, top-{report['k']} candidates)\n")
    print(table(report["results"]))
    print("\n" + legend(report["targets"]))
    if "best_sentence" in report:
        best = {k: "-" if v is None else f"{v:.3f}" for k, v in report["best_sentence"].items()}
        print(
            f"\nBest sentence (the answer model's probability for the best strip of the candidates) as a grader: "
            f"AUROC {best['out-of-corpus']} against out of corpus, {best['unanswerable']} against unanswerable"
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


def _snippets(args: argparse.Namespace) -> int:
    from llama_index_crag.evaluation.snippets import snippet_set

    if Path(args.out).resolve() == Path(args.dataset).resolve():
        raise ConfigError("snippets --out must be another folder than --dataset: it would overwrite the dataset")
    counts = snippet_set(Path(args.dataset), Path(args.out), args.min_words)
    print(
        f"Wrote {counts['snippets']} snippets and {counts['questions']} questions to {args.out} "
        f"({counts['left_out']} answerable questions left out: no snippet holds their answer)."
    )
    return 0
