"""Human-labelled (question, passage, label) pairs from a JSONL file, split for training the reader.

Each line is ``{"question", "passage", "label"}`` (1: the passage answers), with an
optional ``source`` and ``kind`` (how the label was decided) and ``title`` (the article a
passage comes from). About a tenth of each source is held out, by group: pairs sharing
a ``title`` (one article's paragraphs and sentences) or, without one, the same question
stay on the same side, so that a held-out figure measures reading on questions and
paragraphs the model never saw. The split is a hash of the group, so it is the same on
every run and every machine: a resumed run, and a later measurement that must use
only rows held out from training (the answer check on HaluEval's rows), see the same
split.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence

import numpy as np

from llama_index_crag.calibration.training import Pair, PairSet
from llama_index_crag.datasets import numbered_rows
from llama_index_crag.errors import DatasetError

#: The share of each source's groups held out for checkpoint selection and figures.
HELD_OUT_SHARE = 0.1


def group_of(row: Mapping[str, Any]) -> str:
    """The group a pair is held out with: its source and article title, else its source and question."""
    source = str(row.get("source", ""))
    return f"{source}|title:{row['title']}" if row.get("title") else f"{source}|q:{row['question']}"


def group_folds(groups: Sequence[str], folds: int) -> np.ndarray:
    """The cross-validation fold of each item, by its group (a question, an article), so that a group never
    straddles train and test: the sorted groups in a seeded permutation, dealt to the folds in turn."""
    order = {g: i % folds for i, g in enumerate(np.random.default_rng(0).permutation(sorted(set(groups))))}
    return np.asarray([order[g] for g in groups])


def is_held_out(row: Mapping[str, Any], share: float = HELD_OUT_SHARE) -> bool:
    """Whether a pair belongs to the held-out part: a stable hash of its group, not a random draw."""
    digest = hashlib.sha1(group_of(row).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < share


def read_rows(path: Path | str) -> Iterator[Dict[str, Any]]:
    """The file's rows, each checked for a non-empty question and passage and a 0/1 label."""
    for where, row in numbered_rows(Path(path)):
        question, passage, label = row.get("question"), row.get("passage"), row.get("label")
        # No coercion: a label of 0.9 is not 0, and a list is not a passage.
        if not (isinstance(question, str) and question.strip() and isinstance(passage, str) and passage.strip()):
            raise DatasetError(f"{where}: needs a question and a passage, each non-empty text")
        if isinstance(label, bool) or label not in (0, 1):  # 0.9 is not 0, and true is not 1
            raise DatasetError(f"{where}: needs a label of 0 or 1, not {label!r}")
        yield row


def load_labelled_pairs(
    path: Path | str, share: float = HELD_OUT_SHARE, limit: Optional[int] = None, seed: int = 0
) -> PairSet:
    """Pairs from ``path`` split into training and held-out parts by group (``limit`` samples the training part)."""
    train: List[Pair] = []
    held_out: List[Pair] = []
    for row in read_rows(path):
        pair = Pair(
            query=str(row["question"]),
            passage=str(row["passage"]),
            label=int(row["label"]),
            kind=f"{row.get('source', 'labelled')}:{row.get('kind', 'pair')}",
            doc_id=group_of(row),
        )
        (held_out if is_held_out(row, share) else train).append(pair)
    if limit is not None and limit < len(train):
        train = random.Random(seed).sample(train, limit)
    if not train or not held_out:
        raise DatasetError(f"{path} gives {len(train)} training and {len(held_out)} held-out pairs: it needs both")
    return PairSet(train, held_out)
