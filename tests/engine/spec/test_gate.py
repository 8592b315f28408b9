"""The seed's adaptive gate (spec/mtp-speculation.md §5.1), driven with synthetic timings."""

from __future__ import annotations

import pytest

from engine.spec.events import CALIBRATING, DISABLED, ON
from engine.spec.gate import AdaptiveGate, FixedPolicy, RoundTiming, update_ema


def _round(seconds: float) -> RoundTiming:
    return RoundTiming(draft_s=seconds * 0.2, verify_s=seconds * 0.7, post_s=seconds * 0.1)


def _calibrate(g: AdaptiveGate, step_s: float = 0.01) -> None:
    for _ in range(4):
        assert g.decide(8).k == 0
        g.observe_plain(step_s)


def test_ema_first_sample_initialises_and_zero_is_replaced():
    assert update_ema(0.0, 5.0) == 5.0
    assert update_ema(4.0, 8.0) == pytest.approx(0.25 * 8 + 0.75 * 4)
    assert update_ema(0.0, 0.3) == 0.3   # an EMA stuck at 0 (all rejected) takes the next sample whole


def test_baseline_of_four_plain_steps_then_drafts():
    g = AdaptiveGate(3)
    assert g.state == CALIBRATING
    for i in range(4):
        assert g.decide(8).k == 0
        g.observe_plain(0.010 + i * 0.001)
    assert g.pop_change() == "baseline ready"
    assert g.state == ON
    assert g.decide(8).k == 3
    assert g.decide(2).k == 2          # the budget caps k
    # EMA over 100, 90.9, 83.3, 76.9 tok/s
    ema = 0.0
    for s in (0.010, 0.011, 0.012, 0.013):
        ema = update_ema(ema, 1 / s)
    assert g.no_mtp_tps == pytest.approx(ema)


def test_intervals_of_100us_or_less_are_dropped():
    g = AdaptiveGate(3)
    g.observe_plain(100e-6)
    g.observe_plain(50e-6)
    assert g.baseline_seen == 0 and g.no_mtp_tps == 0.0
    g.observe_plain(101e-6)
    assert g.baseline_seen == 1


def test_low_acceptance_disables_on_second_bad_window_after_four():
    g = AdaptiveGate(3)
    _calibrate(g)
    # fast rounds (never "slow"), zero acceptance
    for window in range(1, 6):
        g.observe_round(3, 0, _round(0.001))
        if window < 5:
            assert g.state == ON, window
    # window 4: first low window; window 5: second -> disabled
    assert g.state == DISABLED and g.pop_change() == "low acceptance"
    assert g.decide(8).k == 0
    # sticky: nothing changes it back within the request
    for _ in range(10):
        g.observe_plain(0.01)
        g.observe_round(3, 3, _round(0.0001))
    assert g.state == DISABLED and g.pop_change() is None


def test_no_decision_before_four_windows():
    g = AdaptiveGate(3)
    _calibrate(g)
    for _ in range(3):
        g.observe_round(3, 0, _round(1.0))
    assert g.state == ON and g.low_accept == 0 and g.slow_windows == 0


def test_slower_than_baseline_disables_after_two_slow_windows():
    g = AdaptiveGate(2)
    _calibrate(g, 0.010)                 # 100 tok/s
    # acceptance 1.0, but 3 tokens in 0.0312 s = 96 tok/s < 98
    for _ in range(5):
        g.observe_round(2, 2, _round(0.0312))
    assert g.state == DISABLED and g.pop_change() == "slower than no-MTP"
    assert g.disable_detail["threshold"] == pytest.approx(0.98 * 100)


def test_a_good_window_resets_the_bad_counters():
    g = AdaptiveGate(2)
    _calibrate(g, 0.010)
    seq = [(0, 0.001)] * 4 + [(2, 0.001)] + [(0, 0.001)]
    for acc, s in seq:
        g.observe_round(2, acc, _round(s))
    # EMA after four zeros is 0, then 1.0 replaces it (EMA <= 0 rule), then 0.75 -> never < 0.25 twice
    assert g.state == ON


def test_round_timer_includes_acceptance_time_work():
    g = AdaptiveGate(1)
    _calibrate(g, 0.010)
    g.observe_round(1, 1, RoundTiming(0.001, 0.005, 0.014))   # 2 tokens in 20 ms = 100 tok/s
    assert g.mtp_tps == pytest.approx(100.0)


def test_fixed_policy():
    on, off = FixedPolicy(4), FixedPolicy(0)
    assert on.decide(8).k == 4 and on.decide(1).k == 1 and on.decide(0).kind == "plain"
    assert off.decide(8).k == 0 and not off.uses_mtp and on.uses_mtp


def test_an_untimed_round_counts_its_window_and_acceptance_but_not_its_time():
    """A round that included a compile or an eager call beside one (`RoundTiming.timed` False) is a window
    with an acceptance sample, as any round, but no tokens/s sample (as the seed drops intervals <= 100 us);
    an untimed plain step (0 s) is no baseline step."""
    g = AdaptiveGate(2)
    g.observe_plain(0.0)
    assert g.baseline_seen == 0
    _calibrate(g)
    g.observe_round(2, 2, RoundTiming(1.0, 4.0, 0.5, timed=False))     # seconds: a compile inside
    assert g.windows == 1 and g.accept == 1.0 and g.mtp_tps == 0.0
    for _ in range(4):
        g.observe_round(2, 2, _round(0.012))
    assert g.mtp_tps == pytest.approx(3 / 0.012) and g.state == ON
