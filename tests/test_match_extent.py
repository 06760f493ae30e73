"""Prompt lookup by match extent: the extent of a match, its classes, and a draft length kept per class."""

from __future__ import annotations

import pytest

from cortexstream.engine.adaptive_draft import AdaptiveDraftLength
from cortexstream.engine.match_extent import EXTENT_CAP, EXTENT_CLASSES, EXTENT_PRIORS, extent_class
from cortexstream.engine.ngram_proposer import NgramIndex
from cortexstream.errors import InvalidArgumentError


def test_extent_counts_how_far_back_the_copy_goes():
    source = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    index = NgramIndex.from_tokens(source + [0] + [4, 5, 6, 7], 3)  # copying 4..7 from the source
    start, size = index.match(3)
    assert (start, size) == (4, 3)  # the gram 5 6 7
    assert index.extent(start, size, 32) == 4  # and 4 before it: the copy is 4 tokens long
    assert index.extent(start, size, 3) == 3  # counted up to the cap
    index.extend([8])
    assert index.extent(*index.match(3), 32) == 5  # one more copied token, one more of extent
    chance = NgramIndex.from_tokens([1, 2, 9, 3, 2], 3)  # the last token occurred once before, after another one
    assert chance.extent(*chance.match(3), 32) == 1


def test_extent_refuses_what_is_not_an_earlier_occurrence_of_the_tail():
    index = NgramIndex.from_tokens([1, 2, 3, 1, 2], 3)
    with pytest.raises(InvalidArgumentError, match="^start, size:"):
        index.extent(2, 2, 32)
    with pytest.raises(InvalidArgumentError, match="^start, size:"):
        index.extent(3, 2, 32)  # the tail itself is not an earlier occurrence


def test_extent_classes():
    assert [extent_class(e) for e in (1, 2, 3, 4, 8, 9, 16, 17, 500)] == [1, 2, 2, 4, 4, 9, 9, 17, 17]
    assert EXTENT_CAP == EXTENT_CLASSES[-1] and set(EXTENT_PRIORS) == set(EXTENT_CLASSES)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(InvalidArgumentError, match="^extent:"):
            extent_class(bad)


def by_extent(**kwargs) -> AdaptiveDraftLength:
    return AdaptiveDraftLength(4, contexts=EXTENT_PRIORS, cost_per_draft=0.2, **kwargs)


def test_a_long_copy_drafts_and_a_chance_match_does_not():
    draft = by_extent()
    assert draft.next_k() > 0  # nothing seen yet: read, to find out
    assert draft.draft_length(17) == 4  # a long copy: the whole k
    draft.record(4, 4)
    assert draft.k > 0  # a copy that went on is expected to go on: keep reading
    assert draft.next_k() > 0 and draft.draft_length(1) == 0  # a chance match of one token does not pay
    rates = draft.acceptance_rate, draft.continuation_rate  # in class 1 now
    assert rates == pytest.approx(EXTENT_PRIORS[1])
    draft.record(0, 0)  # which drafted nothing: no estimate changes, and no class is expected next
    draft.next_k()
    assert draft.draft_length(1) == 0 and (draft.acceptance_rate, draft.continuation_rate) == rates


def test_each_class_keeps_its_own_rates():
    draft = by_extent(decay=0.5)
    for _ in range(6):
        draft.next_k()
        draft.draft_length(9)
        draft.record(4, 0)  # long matches that are rejected (a text that quotes and then departs)
    draft.next_k()
    assert draft.draft_length(9) == 0  # class 9 lost its drafts
    draft.record(0, 0)
    draft.next_k()
    assert draft.draft_length(17) == 4  # class 17 kept its prior


def test_reads_stop_when_what_they_find_does_not_pay_and_probes_test_a_class_again():
    draft = AdaptiveDraftLength(4, contexts=EXTENT_PRIORS, cost_per_draft=0.2, probe_every=4, max_backoff=2)
    reads = []
    for step in range(40):
        k = draft.next_k()
        if k == 0:
            continue
        reads.append(step)
        n = draft.draft_length(1)  # only chance matches (open-ended chat)
        draft.record(n, 0)
    assert draft.k == 0
    late = [s for s in reads if s >= 10]
    assert late and all(b - a >= 4 for a, b in zip(late, late[1:]))  # then only probes, every interval or more
    probe = AdaptiveDraftLength(4, contexts=EXTENT_PRIORS, cost_per_draft=0.2, probe_every=1)
    probe.next_k()
    probe.draft_length(1)
    probe.record(0, 0)
    assert probe.k == 0 and probe.next_k() == 1  # a probe ...
    assert probe.draft_length(1) == 1  # ... drafts one token even where the class does not pay, to test it


def test_draft_length_refuses_what_it_cannot_use():
    with pytest.raises(InvalidArgumentError, match="^draft_length:"):
        AdaptiveDraftLength(4).draft_length(1)
    with pytest.raises(InvalidArgumentError, match="^context:"):
        by_extent().draft_length(3)
    with pytest.raises(InvalidArgumentError, match="^contexts:"):
        AdaptiveDraftLength(4, contexts={1: (0.5, 1.5)})
    with pytest.raises(InvalidArgumentError, match="^contexts:"):
        AdaptiveDraftLength(4, contexts={None: (0.5, 0.5)})


def test_not_adaptive_drafts_k_max_wherever_a_match_is():
    draft = AdaptiveDraftLength(4, adaptive=False, contexts=EXTENT_PRIORS)
    assert draft.next_k() == 4 and draft.draft_length(1) == 4 and draft.draft_length(None) == 0
