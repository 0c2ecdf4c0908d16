"""Print the instrumentation span tree of two queries: one answered, one the documents cannot answer.

Each corrective step (grade, refine, rewrite, fallback, regrade, quote, check) is one span
under the engine's, with its outcome and sizes; the parts' own spans (the retrievers, the
embedding model) sit inside the step that called them. Any span handler on LlamaIndex's
root dispatcher sees the same tree (a tracing integration, or this one).
Run: python examples/span_tree.py
"""

from typing import Any, Dict, List, Optional

from llama_index.core import VectorStoreIndex
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.span_handlers import SimpleSpanHandler

from llama_index_crag import CorrectiveQueryEngine
from llama_index_crag.core.loop import StepRecord
from llama_index_crag.datasets import load_documents
from llama_index_crag.local.models import default_embed_model


class StepTree(SimpleSpanHandler):
    """A span handler that keeps what each corrective step reported when its span ended."""

    steps: Dict[str, StepRecord] = {}

    def prepare_to_exit_span(
        self, id_: str, bound_args: Any, instance: Optional[Any] = None, result: Optional[Any] = None, **kwargs: Any
    ) -> Any:
        if isinstance(result, StepRecord):
            self.steps[id_] = result
        return super().prepare_to_exit_span(id_, bound_args, instance, result, **kwargs)

    def print_tree(self) -> None:
        """Each span by name (its id without the uuid), children indented, steps with what they reported."""
        spans = sorted(self.completed_spans + self.dropped_spans, key=lambda s: s.start_time)
        children: Dict[Optional[str], List[Any]] = {}
        for span in spans:
            children.setdefault(span.parent_id, []).append(span)

        def show(parent: Optional[str], depth: int) -> None:
            for span in children.get(parent, []):
                name = span.id_.rsplit("-", 5)[0]
                step = self.steps.get(span.id_)
                said = f"  outcome={step.outcome} {step.sizes}" if step else ""
                print(f"{'  ' * depth}{name}{said}")
                show(span.id_, depth + 1)

        show(None, 0)


def main() -> None:
    index = VectorStoreIndex.from_documents(load_documents(), embed_model=default_embed_model())
    engine = CorrectiveQueryEngine.from_defaults(index=index)  # no LLM: it answers by quoting
    for question in ["Who is the CEO of Harbor Analytics?", "Who wrote the novel Moby-Dick?"]:
        tree = StepTree()
        get_dispatcher().add_span_handler(tree)
        try:
            crag = (engine.query(question).metadata or {})["crag"]
        finally:
            get_dispatcher().span_handlers.remove(tree)
        print(f"{question}  action={crag['action']} abstained={crag['abstained']}")
        tree.print_tree()
        print()


if __name__ == "__main__":
    main()
