"""Grade with the reranker the pipeline already runs: FlagEmbeddingReranker plus UpstreamScoreScorer.

The reranker sits in ``node_postprocessors`` and scores the candidates once; the
grader reuses those scores (a sigmoid of the reranker's logit) instead of calling
a second model. Knowledge strips, which have no upstream score, are scored by the
same reranker.

The default model, BAAI/bge-reranker-v2-m3, comes from the Hugging Face model hub:
the first run needs network access and downloads about 2.3 GB. Offline, pass a
local model directory with ``--model`` (and set HF_HUB_OFFLINE=1, or the hub is
retried for about a minute before the script gives up).

The thresholds below are placeholders, not a calibration: fit ``--upper`` and
``--lower`` for your reranker on labelled questions from your own data.

Needs the FlagEmbedding extra: pip install 'llama-index-crag[flagembedding]'
Run: python examples/flag_reranker_grader.py [--model BAAI/bge-reranker-v2-m3 | --model /path/to/model]
"""

import argparse
import sys
from pathlib import Path
from typing import NoReturn

from llama_index.core import VectorStoreIndex
from llama_index.core.postprocessor.types import BaseNodePostprocessor

from llama_index_crag import CorrectiveQueryEngine
from llama_index_crag.datasets import load_documents, load_questions
from llama_index_crag.local.models import default_embed_model, default_llm
from llama_index_crag.scorers import UpstreamScoreScorer


def load_reranker(model: str) -> BaseNodePostprocessor:
    """The FlagEmbedding reranker, or exit 2 with one line that says why it could not load."""
    local = Path(model).expanduser()
    if model.startswith((".", "/", "~")) and not local.is_dir():
        fail(f"no model directory at {model}")
    where = "local directory" if local.is_dir() else "Hugging Face model hub (needs network access)"
    print(f"Loading reranker {model} from the {where}.")
    try:
        from llama_index.postprocessor.flag_embedding_reranker import FlagEmbeddingReranker

        return FlagEmbeddingReranker(model=str(local) if local.is_dir() else model, top_n=5)
    except (ImportError, OSError, ValueError) as exc:
        first_sentence = " ".join(str(exc).split()).split(". ")[0]
        fail(
            f"cannot load reranker {model!r} ({type(exc).__name__}: {first_sentence}); "
            "a model name is fetched from the Hugging Face model hub, which needs network access: "
            "offline, pass --model with a local model directory"
        )


def fail(message: str) -> NoReturn:
    print(f"flag_reranker_grader.py: {message}", file=sys.stderr)
    sys.exit(2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="BAAI/bge-reranker-v2-m3", help="model hub name or local directory")
    parser.add_argument("--upper", type=float, default=0.5, help="CORRECT at or above this reranker score")
    parser.add_argument("--lower", type=float, default=0.1, help="INCORRECT below this reranker score")
    args = parser.parse_args()

    reranker = load_reranker(args.model)
    index = VectorStoreIndex.from_documents(load_documents(), embed_model=default_embed_model())
    llm, described = default_llm()
    print(f"Generator: {described}\n")
    engine = CorrectiveQueryEngine.from_defaults(
        index=index,
        llm=llm,
        node_postprocessors=[reranker],
        scorer=UpstreamScoreScorer.from_reranker(reranker),
        upper=args.upper,
        lower=args.lower,
        similarity_top_k=10,  # retrieve 10, the reranker keeps its top 5
    )

    by_id = {q.qid: q.question for q in load_questions()}
    for qid in ("q001", "q025", "q035"):
        response = engine.query(by_id[qid])
        crag = response.metadata["crag"]
        print(f"Q: {by_id[qid]}\nA: {' '.join(str(response).split())}")
        print(f"   action={crag['action']} top_score={crag['top_score']} abstained={crag['abstained']}")
        for grade in crag["nodes"]:
            print(f"   {grade['source']:>15}  {grade['score']:.4f}  {grade['label']}")
        print()


if __name__ == "__main__":
    main()
