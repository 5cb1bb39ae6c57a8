"""The suffix proposer's tables and drafting rules (its losslessness is in test_speculative.py)."""

from __future__ import annotations

import pytest

from lab.errors import LabError
from lab.request import Request, SamplingParams
from lab.spec.suffix import ContinuationTable, SuffixProposer


def request(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id, list(token_ids), SamplingParams(max_tokens=16))


def test_table_counts_every_suffix_and_uncounts_to_empty() -> None:
    table = ContinuationTable(max_n=2)
    table.add([5, 6, 5, 6, 7])
    assert table.get((5,)) == {6: 2} and table.get((6,)) == {5: 1, 7: 1} and table.get((5, 6)) == {5: 1, 7: 1}
    table.add([5, 6, 5, 6, 7], sign=-1)
    assert table.counts == {}


def test_a_sure_repeat_drafts_up_to_k_and_a_first_sight_drafts_nothing() -> None:
    proposer = SuffixProposer(max_n=4, min_confidence=0.3)
    assert proposer.propose_one(request("a", [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]), 4) == [3, 4, 1, 2]
    assert proposer.propose_one(request("b", [7, 8, 9]), 4) == [], "nothing seen before: no draft"


def test_the_draft_stops_where_confidence_falls_below_the_threshold() -> None:
    # after (1, 2) came 3 once and 9 twice; local counts weigh 4: p(9) = 8 / (4 + 8 + 1) = 0.615
    tokens = [1, 2, 3, 0, 1, 2, 9, 0, 1, 2, 9, 0, 1, 2]
    assert SuffixProposer(max_n=2, min_confidence=0.65).propose_one(request("a", tokens), 4) == []
    assert SuffixProposer(max_n=2, min_confidence=0.6).propose_one(request("a", tokens), 1) == [9]


def test_a_draft_reports_each_token_s_estimated_probability_as_its_confidence() -> None:
    """count / (total + 1) of each chosen continuation, local counts weighted: what a cascade's long chain is cut by."""
    tokens = [1, 2, 3, 0, 1, 2, 9, 0, 1, 2, 9, 0, 1, 2]
    draft = SuffixProposer(max_n=2, min_confidence=0.1).propose([request("a", tokens)], 2, [None])["a"]
    # NOTE: 9 as above (8 / 13); then (2, 9) was followed by 0 twice: 8 / (8 + 1)
    assert draft.token_ids == [9, 0] and draft.confidence == pytest.approx([8 / 13, 8 / 9])


def test_finished_requests_teach_later_ones_and_the_oldest_leave_first() -> None:
    proposer = SuffixProposer(max_n=3, min_confidence=0.1, max_cached_requests=1)
    first = request("a", [10, 11, 12, 13, 14])
    proposer.propose_one(first, 2)
    proposer.free("a")
    assert proposer.propose_one(request("b", [99, 10, 11]), 3) == [12, 13, 14]
    proposer.free("b")   # NOTE: max_cached_requests=1: "a" leaves the global table
    assert proposer.propose_one(request("c", [98, 10, 11]), 3) == [], "evicted request still drafting"
    assert proposer.stats()["spec/suffix_cached_requests"] == 1


def test_remembered_tokens_teach_like_a_finished_request_and_share_its_window() -> None:
    proposer = SuffixProposer(max_n=3, min_confidence=0.1, max_cached_requests=1)
    proposer.remember([10, 11, 12, 13, 14])   # NOTE: an answer served before this proposer's requests
    assert proposer.propose_one(request("a", [99, 10, 11]), 3) == [12, 13, 14]
    proposer.remember([20, 21, 22])
    assert proposer.propose_one(request("b", [98, 10, 11]), 3) == [], "the older remembered answer did not leave"
    assert proposer.propose_one(request("c", [97, 20]), 2) == [21, 22]
    no_history = SuffixProposer(max_cached_requests=0)
    no_history.remember([1, 2, 3])
    assert no_history.global_table.counts == {}, "max_cached_requests=0 kept a remembered answer"


def test_reset_history_forgets_finished_requests() -> None:
    proposer = SuffixProposer(max_n=3, min_confidence=0.3)
    proposer.propose_one(request("a", [10, 11, 12, 13]), 2)
    proposer.free("a")
    proposer.reset_history()
    assert proposer.propose_one(request("b", [10, 11]), 2) == [] and proposer.global_table.counts == {}


def test_bad_settings_name_the_fix() -> None:
    with pytest.raises(LabError, match="min_confidence"):
        SuffixProposer(min_confidence=1.5)
