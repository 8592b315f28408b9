"""Per-token stop checks (spec §3.4) and the per-request statistics built from round events (§7)."""

from __future__ import annotations

import pytest

from engine.spec.events import RoundEvent, SpecStats
from engine.spec.stops import StopChecker, StopRule

VOCAB = {1: b"he", 2: b"llo", 3: b" wor", 4: b"ld", 5: b"\xe2\x82", 6: b"\xac", 9: b""}


def _tb(t: int) -> bytes:
    return VOCAB[t]


def test_eos_ends_on_that_token():
    c = StopChecker(StopRule(max_tokens=10, eos_ids=frozenset({9})), _tb)
    assert c.push_many([1, 2, 9, 3, 4]) == 3
    assert c.finish_reason == "stop" and c.tokens == [1, 2, 9]


def test_max_tokens_counts_every_token():
    c = StopChecker(StopRule(max_tokens=2))
    assert c.push(1) is None and c.push(2) == "length"
    with pytest.raises(RuntimeError):
        c.push(3)


def test_stop_string_split_across_tokens_is_found_and_cut():
    c = StopChecker(StopRule(max_tokens=10, stop=("lo wo",)), _tb)
    assert c.push_many([1, 2, 3, 4]) == 3
    assert c.finish_reason == "stop" and c.stop_string == "lo wo"
    assert c.output_bytes() == b"hel"


def test_stop_string_inside_a_multibyte_character_boundary():
    c = StopChecker(StopRule(max_tokens=10, stop=("€",)), _tb)
    assert c.push(5) is None
    assert c.push(6) == "stop" and c.output_bytes() == b""


def test_first_stop_wins():
    c = StopChecker(StopRule(max_tokens=10, stop=("world", "llo")), _tb)
    c.push_many([1, 2, 3, 4])
    assert c.tokens == [1, 2] and c.stop_string == "llo"


def _ev(k, a, emitted, change=None, n=0):
    return RoundEvent(t=0.0, slot=0, task=0, kind="round" if k else "plain", k=k, accepted=a,
                      accepted_flags=tuple(j < a for j in range(k)), emitted=emitted, round_s=0.01,
                      gate_change=change, n_generated=n)


def test_stats_per_position_divides_by_rounds_that_drafted_the_position():
    s = SpecStats()
    for ev in (_ev(0, 0, 1, "baseline ready", 1), _ev(3, 3, 4), _ev(3, 1, 2), _ev(1, 1, 2), _ev(2, 0, 1)):
        s.add(ev)
    assert s.drafted == 9 and s.accepted == 5 and s.rounds == 4 and s.plain_steps == 1
    assert s.accepted_per_position == [3 / 4, 1 / 3, 1 / 2]
    assert s.mean_accepted_length == pytest.approx(1 + 5 / 4)
    assert s.accept_rate == pytest.approx(5 / 9)
    assert s.as_dict()["gate"] == [{"token": 1, "state": "on", "reason": "baseline ready"}]


def test_stats_count_only_emitted_drafts_when_a_stop_cuts_the_round():
    s = SpecStats()
    s.add(_ev(4, 4, 2))      # EOS on the second accepted draft
    assert s.accepted == 2 and s.accepted_per_position == [1.0, 1.0, 0.0, 0.0]
