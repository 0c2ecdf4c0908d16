"""Quickstart: a CorrectiveQueryEngine over the bundled sample corpus, offline.

Asks one answerable question, one on-topic question the corpus cannot answer, and
one off-topic question, and prints each answer with the engine's decision trace.
The generator is a local Ollama model when one answers, else the bundled GGUF in
llama.cpp. Run: python examples/quickstart.py
"""

import asyncio

from llama_index.core import VectorStoreIndex
from llama_index.core.base.response.schema import RESPONSE_TYPE

from llama_index_crag import CorrectiveQueryEngine
from llama_index_crag.datasets import load_documents, load_questions
from llama_index_crag.local.models import default_embed_model, default_llm


def show(question: str, response: RESPONSE_TYPE) -> None:
    crag = response.metadata["crag"]
    print(f"Q: {question}")
    print(f"A: {' '.join(str(response).split())}")
    print(f"   action={crag['action']} top_score={crag['top_score']} abstained={crag['abstained']}")
    if crag["abstained"]:
        print(f"   why: {crag['abstain_reason']}")
    print(f"   timings_ms: {crag['timings_ms']}\n")


def main() -> None:
    index = VectorStoreIndex.from_documents(load_documents(), embed_model=default_embed_model())
    llm, described = default_llm()
    print(f"Generator: {described}\n")
    engine = CorrectiveQueryEngine.from_defaults(index=index, llm=llm)

    by_id = {q.qid: q.question for q in load_questions()}
    questions = [
        by_id["q001"],  # answerable: the CEO is named in the company overview
        by_id["q025"],  # on topic, but the corpus never says when Singapore opened
        by_id["q035"],  # off topic: nothing in the corpus is about Australia
    ]
    for question in questions:
        show(question, engine.query(question))

    question = by_id["q008"]
    show(question, asyncio.run(engine.aquery(question)))


if __name__ == "__main__":
    main()
