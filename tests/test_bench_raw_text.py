"""benchmarks/bench_raw_text.py's resume counter (issue 33 item 6): documents repeated and missing after a resume,
as pure functions, and end to end on the Hugging Face peer over a 200-document corpus."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_raw_text as bench  # noqa: E402

EOS = 9


def token_batches():
    """Three batches of per-token document ids (-1: padding): documents 0-5, document 2 across two batches."""
    return [np.array([[0, 0, 1, 1], [2, 2, 2, 2]]), np.array([[2, 3, 3, -1], [4, 4, 4, 4]]), np.array([[5, 5, -1, -1]])]


def test_a_duplicated_batch_counts_its_documents_as_repeated():
    reference = bench.document_token_counts(token_batches())
    assert reference == {0: 2, 1: 2, 2: 5, 3: 2, 4: 4, 5: 2}
    assert bench.resume_damage(reference, reference) == {"documents": 6, "repeated": 0, "missing": 0}
    batches = token_batches()
    resumed = bench.document_token_counts(batches[:2] + batches[1:])  # the second batch delivered twice
    assert bench.resume_damage(reference, resumed) == {"documents": 6, "repeated": 3, "missing": 0}


def test_a_lost_batch_counts_its_documents_as_missing_even_when_only_part_of_one_is_lost():
    reference = bench.document_token_counts(token_batches())
    batches = token_batches()
    resumed = bench.document_token_counts([batches[0], batches[2]])
    assert bench.resume_damage(reference, resumed) == {"documents": 6, "repeated": 0, "missing": 3}  # 2 (partly), 3, 4


def lane_rows():
    """Documents (tokens with EOS) packed into samples of 4 tokens in 2 lanes; sample id = lane + 2 x index."""
    documents = {(1, 2, EOS): 0, (3, 4, 5, 6, 7, EOS): 1, (8, EOS): 2, (1, 1, EOS): 3}
    lanes = {0: [1, 2, EOS, 3, 4, 5, 6, 7, EOS], 1: [8, EOS, 1, 1, EOS]}
    rows = [(lane + 2 * index, np.array(stream[4 * index:4 * index + 4]))
            for lane, stream in lanes.items() for index in range(-(-len(stream) // 4))]
    return rows, documents


def test_lane_documents_are_found_by_their_tokens_in_sample_order():
    rows, documents = lane_rows()
    counts, unmatched = bench.lane_document_counts(rows[::-1], 2, EOS, documents)  # any delivery order
    assert counts == {0: 3, 1: 6, 2: 2, 3: 3} and unmatched == 0
    repeated, unmatched = bench.lane_document_counts(rows + [rows[1]], 2, EOS, documents)  # a sample twice
    assert bench.resume_damage(counts, repeated)["repeated"] >= 1
    dropped, unmatched = bench.lane_document_counts(rows[:1] + rows[2:], 2, EOS, documents)  # a sample lost
    assert bench.resume_damage(counts, dropped)["missing"] >= 1 and unmatched > 0


class IgnoresState:
    """A loader that forgets the state it is given: a resume that starts over."""

    def __init__(self, loader):
        self.loader = loader

    def __iter__(self):
        return iter(self.loader)

    def state_dict(self):
        return self.loader.state_dict()

    def load_state_dict(self, state):
        pass


@pytest.mark.slow  # importing datasets and torchdata is most of its ~5-10 s
def test_the_peer_resume_on_200_documents_and_a_resume_that_starts_over(tmp_path):
    from conftest import shared_path

    corpus, tokenizer = shared_path("corpora/mix.jsonl.zst"), str(shared_path("tokenizers/gpt2_hf_tokenizer.json"))
    paths = bench.write_corpus(bench.corpus_records(corpus, max_docs=200), tmp_path, 2)

    def make():
        return bench.hf_loader(bench.hf_dataset(paths, tokenizer, 64, with_ids=True), 16, 0)

    def delivered(batches):
        return bench.document_token_counts(b["doc_ids"].numpy() for b in batches)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchdata's deprecation warning at every loader
        reference_batches = list(make())
        head = len(reference_batches) // 2
        resumed = bench.run_with_resumes(make, [head])
        restarted = bench.run_with_resumes(lambda: IgnoresState(make()), [head])
    reference = delivered(reference_batches)
    assert len(reference) == 200 and len(resumed) == len(reference_batches)
    assert set(bench.resume_damage(reference, delivered(resumed))) == {"documents", "repeated", "missing"}
    # Starting over delivers the first `head` batches' documents twice (the one the stop cut in two as well).
    damage = bench.resume_damage(reference, delivered(restarted))
    assert damage == {"documents": 200, "repeated": len(delivered(restarted[:head])), "missing": 0}
