"""A noisy on-topic snippet set derived from a dataset: the case CRAG exists for, measurable here.

Search snippets about the right subject that do not hold the answer defeat every
simple relevance signal. No such public set ships with the project, but one can be
cut from any set in the shared format: each document becomes snippets of a few
sentences, and a question's relevant snippets are the ones that hold its answer (a
short-answer string, or a labelled evidence sentence as in SciFact). The
out-of-corpus protocol then drops those snippets, and what retrieval finds instead
is mostly the rest of the same document: on the subject, without the answer.

``llama-crag snippets --dataset DIR --out DIR`` writes the derived set; measure it
with ``llama-crag grade-report --dataset DIR``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

from llama_index_crag.datasets import load_questions, normalise_text, numbered_rows, text_field
from llama_index_crag.errors import ConfigError, DatasetError
from llama_index_crag.text.strips import decompose


def _group(sentences: List[str], min_words: int) -> List[range]:
    """Consecutive sentence indices, each group at least ``min_words`` words (the last may merge back)."""
    groups: List[range] = []
    start, words = 0, 0
    for i, sentence in enumerate(sentences):
        words += len(sentence.split())
        if words >= min_words:
            groups.append(range(start, i + 1))
            start, words = i + 1, 0
    if start < len(sentences):
        if groups:
            groups[-1] = range(groups[-1].start, len(sentences))
        else:
            groups.append(range(start, len(sentences)))
    return groups


def snippet_set(folder: Path | str, out: Path | str, min_words: int = 30) -> Dict[str, int]:
    """Cut ``folder``'s documents into snippets of at least ``min_words`` words and relabel its questions.

    Snippets carry no title: a title can state the answer, and would then put it in
    every snippet of its document.

    An answerable question keeps the snippets of its relevant documents that hold
    an answer string or an evidence sentence; one whose answer no snippet holds
    (a paraphrased answer) is left out. An unanswerable question's relevant
    documents (SQuAD's on-topic passage that does not answer) become all their
    snippets. Returns the counts written.
    """
    folder, out = Path(folder), Path(out)
    if min_words < 1:
        raise ConfigError("min_words must be at least 1")
    snippets: Dict[str, List[Dict[str, Any]]] = {}
    spans: Dict[str, List[range]] = {}
    for where, row in numbered_rows(folder / "corpus.jsonl"):
        doc_id = text_field(row, where, "doc_id")
        sentences = [str(s) for s in row.get("sentences") or []]
        if sentences:
            # Whole labelled sentences, so a snippet holds an evidence sentence or does not.
            spans[doc_id] = _group(sentences, min_words)
            parts = [" ".join(sentences[i] for i in span) for span in spans[doc_id]]
        else:
            text = str(row.get("text", ""))
            parts = [s.text for s in decompose(text, min_words)] if text.strip() else []
        # No title: a title can state the answer (SciFact's paper titles often state the finding), and then
        # every snippet of the document would hold it.
        snippets[doc_id] = [{"doc_id": f"{doc_id}#{i}", "text": part} for i, part in enumerate(parts)]
    questions: List[Dict[str, Any]] = []
    dropped = 0
    for question in load_questions(folder):  # the loader's checks: a row it refuses is named, not a traceback
        relevant, answerable = question.relevant_doc_ids, question.answerable
        if not answerable:
            ids = [s["doc_id"] for d in relevant for s in snippets.get(d, [])]
        else:
            ids = []
            answers = [a for a in map(normalise_text, question.answers) if a]
            for doc_id in relevant:
                evidence = set(question.evidence.get(doc_id, []))
                doc_spans = spans.get(doc_id, [])
                for i, snippet in enumerate(snippets.get(doc_id, [])):
                    text = normalise_text(snippet["text"]) if answers else ""
                    labelled = i < len(doc_spans) and bool(evidence.intersection(doc_spans[i]))
                    if labelled or any(a in text for a in answers):
                        ids.append(snippet["doc_id"])
            if not ids:
                dropped += 1
                continue
        questions.append(
            {
                "qid": question.qid,
                "question": question.question,
                "answers": list(question.answers),
                "answerable": answerable,
                "relevant_doc_ids": ids,
                **({"split": question.split} if question.split else {}),
            }
        )
    if not questions:
        raise DatasetError(f"no question of {folder} could be labelled at snippet level")
    out.mkdir(parents=True, exist_ok=True)
    corpus = [s for parts in snippets.values() for s in parts]
    with (out / "corpus.jsonl").open("w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(s, ensure_ascii=False) + "\n" for s in corpus)
    with (out / "questions.jsonl").open("w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(q, ensure_ascii=False) + "\n" for q in questions)
    return {"snippets": len(corpus), "questions": len(questions), "left_out": dropped}
