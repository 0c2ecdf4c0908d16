"""A streaming chat over the sample corpus: CondenseQuestionChatEngine around the corrective engine.

The chat engine condenses each turn and the history into a standalone question,
asks the CorrectiveQueryEngine, and streams its answer. The engine's trace is on
the query response, which the chat response keeps as its tool output.
Run: python examples/chat_engine.py
"""

from llama_index.core import VectorStoreIndex
from llama_index.core.chat_engine import CondenseQuestionChatEngine

from llama_index_crag import CorrectiveQueryEngine
from llama_index_crag.datasets import load_documents
from llama_index_crag.local.models import default_embed_model, default_llm


def main() -> None:
    index = VectorStoreIndex.from_documents(load_documents(), embed_model=default_embed_model())
    llm, described = default_llm()
    print(f"Generator: {described}\n")
    engine = CorrectiveQueryEngine.from_defaults(index=index, llm=llm, streaming=True)
    chat = CondenseQuestionChatEngine.from_defaults(query_engine=engine, llm=llm)

    for message in ["What does Harbor Edge do?", "And what is its annual list price per node?"]:
        print(f"User: {message}\nAssistant: ", end="", flush=True)
        streamed = chat.stream_chat(message)
        for token in streamed.response_gen:
            print(token, end="", flush=True)
        query_response = streamed.sources[0].raw_output
        crag = query_response.metadata["crag"]
        print(f"\n   asked: {crag['query']}")
        print(f"   action={crag['action']} top_score={crag['top_score']} abstained={crag['abstained']}\n")


if __name__ == "__main__":
    main()
