"""Draft-length controllers: the fixed policy (`--mtp on`/`off`) and the seed's adaptive gate.

`AdaptiveGate` is the seed's `--mtp-adaptive` (seed/qwen36-mtp-rys_delta.patch, server-context.cpp
`mtp_adaptive_*`) constant for constant, as spec/mtp-speculation.md §5.1 describes it, with the two
changes of §5.3: plain steps keep the MTP state in sync (done by the decode loop) and the round timer
runs to the end of the acceptance-time work. Controllers are torch-free: they see numbers only.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.spec.events import CALIBRATING, DISABLED, ON

# spec §5.1, the seed's constants
BASELINE_TOKENS = 4
MIN_WINDOWS = 4
MAX_BAD_WINDOWS = 2
EMA_ALPHA = 0.25
MIN_ACCEPT = 0.25
MIN_TPS_RATIO = 0.98
MIN_INTERVAL_S = 100e-6   # the seed drops intervals <= 100 us

REASON_BASELINE = "baseline ready"
REASON_LOW_ACCEPT = "low acceptance"
REASON_SLOW = "slower than no-MTP"


def update_ema(ema: float, value: float, alpha: float = EMA_ALPHA) -> float:
    """The seed's EMA: a value <= 0 is replaced by the sample (so the first sample initialises)."""
    if ema <= 0.0:
        return value
    return alpha * value + (1.0 - alpha) * ema


@dataclass(frozen=True, slots=True)
class Decision:
    k: int             # drafts for this round; 0 = plain step
    kind: str          # "plain" / "round" / "probe"
    pred_tps: float = 0.0


@dataclass(frozen=True, slots=True)
class RoundTiming:
    """Wall seconds of one round's parts (spec §4.1: D·k, V(k+1), U(a) + R)."""

    draft_s: float
    verify_s: float
    post_s: float          # acceptance-time work: MTP cache update and rollback
    # False where the round included a call whose time is not its steady state (a compile on first use, an
    # eager call while its kind compiles: `Qwen35Model.untimed_calls`): policies count it, but learn no time
    timed: bool = True

    @property
    def round_s(self) -> float:
        return self.draft_s + self.verify_s + self.post_s


class DraftController:
    """What the decode loop asks each round. `pop_change` returns the reason of a state change once."""

    name = "base"
    state = ON

    def decide(self, k_cap: int) -> Decision:
        raise NotImplementedError

    def observe_plain(self, step_s: float) -> None:
        """A plain step (one main row + MTP cache sync) took `step_s` seconds (0: not timed, see
        `RoundTiming.timed`)."""

    def observe_round(self, k: int, accepted: int, timing: RoundTiming) -> None:
        """A round verified `k` drafts and accepted `accepted` of them (before any stop)."""

    @property
    def baseline_tps(self) -> float:
        return 0.0

    @property
    def uses_mtp(self) -> bool:
        return True

    def pop_change(self) -> str | None:
        change, self._change = getattr(self, "_change", None), None
        return change


class FixedPolicy(DraftController):
    """`--mtp on --draft K`: always K drafts (capped by the budget); K = 0 is `--mtp off`."""

    def __init__(self, n_draft: int):
        if n_draft < 0:
            raise ValueError(f"n_draft must be >= 0, got {n_draft}")
        self.n_draft = n_draft
        self.name = "on" if n_draft else "off"
        self.state = ON if n_draft else DISABLED

    @property
    def uses_mtp(self) -> bool:
        return self.n_draft > 0

    def decide(self, k_cap: int) -> Decision:
        k = min(self.n_draft, k_cap)
        return Decision(k, "round" if k else "plain")


class AdaptiveGate(DraftController):
    """The seed's gate: 4 timed plain steps, then K-draft rounds until two bad windows in a row."""

    name = "adaptive"

    def __init__(self, n_draft: int):
        if n_draft < 1:
            raise ValueError(f"n_draft must be >= 1, got {n_draft}")
        self.n_draft = n_draft
        self.disabled = False
        self.baseline_seen = 0
        self.windows = 0
        self.low_accept = 0
        self.slow_windows = 0
        self.no_mtp_tps = 0.0
        self.mtp_tps = 0.0
        self.accept = 0.0
        self.disable_detail: dict | None = None
        self._change: str | None = None

    @property
    def state(self) -> str:  # type: ignore[override]
        if self.disabled:
            return DISABLED
        return CALIBRATING if self.baseline_seen < BASELINE_TOKENS else ON

    @property
    def baseline_tps(self) -> float:
        return self.no_mtp_tps

    def decide(self, k_cap: int) -> Decision:
        # server_slot::get_n_draft_max: 0 while disabled or collecting the baseline
        if self.disabled or self.baseline_seen < BASELINE_TOKENS:
            return Decision(0, "plain")
        k = min(self.n_draft, k_cap)
        return Decision(k, "round" if k else "plain", self.mtp_tps)

    def observe_plain(self, step_s: float) -> None:
        # mtp_adaptive_note_no_mtp
        if self.disabled or step_s <= MIN_INTERVAL_S:
            return
        self.no_mtp_tps = update_ema(self.no_mtp_tps, 1.0 / step_s)
        self.baseline_seen += 1
        if self.baseline_seen == BASELINE_TOKENS:
            self._change = REASON_BASELINE

    def observe_round(self, k: int, accepted: int, timing: RoundTiming) -> None:
        # mtp_adaptive_note_mtp, with n_output = accepted + 1 (ids.size())
        if self.disabled or k == 0:
            return
        n_output = accepted + 1
        self.accept = update_ema(self.accept, accepted / k)
        self.windows += 1
        elapsed = timing.round_s
        if timing.timed and elapsed > MIN_INTERVAL_S:     # as the seed drops intervals <= 100 us
            self.mtp_tps = update_ema(self.mtp_tps, n_output / elapsed)
        if self.windows < MIN_WINDOWS:
            return
        self.low_accept = self.low_accept + 1 if self.accept < MIN_ACCEPT else 0
        if self.low_accept >= MAX_BAD_WINDOWS:
            self._disable(REASON_LOW_ACCEPT, self.accept, MIN_ACCEPT)
            return
        if (self.baseline_seen >= BASELINE_TOKENS and self.no_mtp_tps > 0.0 and self.mtp_tps > 0.0
                and self.mtp_tps < self.no_mtp_tps * MIN_TPS_RATIO):
            self.slow_windows += 1
        else:
            self.slow_windows = 0
        if self.slow_windows >= MAX_BAD_WINDOWS:
            self._disable(REASON_SLOW, self.mtp_tps, self.no_mtp_tps * MIN_TPS_RATIO)

    def _disable(self, reason: str, value: float, threshold: float) -> None:
        if self.disabled:
            return
        self.disabled = True
        self._change = reason
        self.disable_detail = {"reason": reason, "value": value, "threshold": threshold,
                               "no_mtp_tps": self.no_mtp_tps, "mtp_tps": self.mtp_tps, "accept": self.accept}
