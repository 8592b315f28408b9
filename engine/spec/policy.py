"""`auto`: choose the number of drafts k each round to maximise expected tokens per second.

spec/mtp-speculation.md §4: k* = argmax_k E_k / T_k with E_k = 1 + sum_{j<=k} r_j from per-position
acceptance estimates and T_k = D·k + V(k+1) + post(k) from measured times; k = 0 is a plain step, and
after MTP went off it is re-probed with one k = 2 round after N plain steps (16, doubling up to 256).
Torch-free: the decode loop feeds it acceptance counts and wall times, nothing else.

T_0 is a low quantile of the recent plain steps, and while MTP is on a short run of plain steps is
taken every PLAIN_CHECK_EVERY rounds: on a CPU a plain step right after a prompt or a round runs
1.5-3x slower than in a run of plain steps (the weights it reads were pushed out of the cache), and
timing noise only ever adds time, so an average of such steps would overrate MTP (demo model: plain
steps 1.9, 1.2, 0.9, 0.8 ms after a prompt, 0.65-0.7 ms from the fifth on).

V(n) is the same low quantile of the recent verifications of n rows (spec §4.2 says EMAs): the two sides
of the comparison must be measured alike. Rounds slow down the same ways (the first rounds of a request
ran 4.0-5.2 ms on the demo model against 3.4-3.7 later in the same request, Intel Xeon, one thread), and
with T_0 a lower quartile and V(n) an average `auto` held MTP off on prompts where `on` was 6 % faster
than `off`, then stayed off for the requests after them.
"""

from __future__ import annotations

from collections import deque

from engine.spec.events import AUTO, CALIBRATING, DISABLED
from engine.spec.gate import Decision, DraftController, RoundTiming

ALPHA_EMA = 0.1          # acceptance EMA weight (spec §4.2)
ALPHA_PRIOR = 0.8        # prior of alpha_1
ALPHA_DECAY = 0.9        # unobserved alpha_j = 0.9 * alpha_{j-1}
TIME_EMA = 0.25          # weight of the time EMAs
HYSTERESIS = 1.03        # change k only for >= 3 % predicted gain
OFF_HYSTERESIS = 1.10    # leave MTP for plain steps only for >= 10 % predicted gain
PRIOR_WEIGHT = 3         # the acceptance prior counts as this many observations
EXPLORE_EVERY = 16       # one round with k+1 drafts after this many rounds at k
SURPRISE = 0.2           # a probe accepting a draft estimated below this restarts the estimate's warm-up
SURPRISE_PREFIX = 0.25   # ... and so does one whose accepted prefix the estimates gave less than this chance
PROBE_K = 2
PROBE_FIRST = 16
PROBE_MAX = 256
PROBE_BUDGET = 0.02      # a lost probe may cost at most 2 % of the plain-step time between probes
PROBE_SETTLE = 4         # plain steps of a request before its first probe (the first ones run cold)
CALIBRATION_STEPS = 3    # plain steps measured before the first round; the first is discarded
PLAIN_WINDOW = 32        # recent plain-step times kept; T_0 is their lower quartile
VERIFY_WINDOW = 16       # recent verification times kept per row count; V(n) is their lower quartile
PLAIN_CHECK_EVERY = 32   # while MTP is on, a run of PLAIN_STREAK plain steps after this many rounds
PLAIN_STREAK = 4
PRIOR_VERIFY_SLOPE = 0.25  # V(n) = V(1)·(1 + c·(n-1)) until two sizes are measured
PRIOR_DRAFT = 0.2        # D = 0.2·T_0 until measured
PRIOR_POST = 0.1         # post(k) = 0.1·T_0 until measured

REASON_BASELINE = "baseline ready"
REASON_OFF = "slower than no-MTP"
REASON_PROBE_WON = "probe won"
REASON_PROBE_LOST = "probe lost"


def _lower_quartile(times: deque[float]) -> float:
    return sorted(times)[(len(times) - 1) // 4]


def _ema(old: float | None, sample: float, weight: float) -> float:
    return sample if old is None else weight * sample + (1.0 - weight) * old


class AutoPolicy(DraftController):
    """Per-slot online estimates of acceptance r_j and of the round cost; keeps them across requests."""

    name = "auto"

    def __init__(self, k_max: int = 8):
        if not 1 <= k_max <= 8:
            raise ValueError(f"k_max must be in 1..8, got {k_max}")
        self.k_max = k_max
        self.alpha: list[float | None] = [None] * (k_max + 1)   # index j = 1..k_max; None = never observed
        self.alpha_n = [0] * (k_max + 1)
        self.t_plain: float | None = None
        self._plain_times: deque[float] = deque(maxlen=PLAIN_WINDOW)
        self.rounds_since_plain = 0
        self._streak = 0                        # plain steps left in the current measuring run
        self.t_verify: dict[int, float] = {}   # rows n -> seconds (lower quartile of _verify_times[n])
        self._verify_times: dict[int, deque[float]] = {}
        self.t_draft: float | None = None       # one draft step
        self.t_post: dict[int, float] = {}     # k -> acceptance-time work
        self.calibration_seen = 0
        self.k_current = 0
        self.off = False
        self.plain_since_off = 0                # plain steps since MTP went off or the last probe, all requests
        self.plain_in_request = 0
        self.probe_every = PROBE_FIRST
        self.rounds_since_explore = 0
        self._probing = False
        self._floor: int | None = None      # _probe_floor() of the current off period (None: not computed yet)
        self._change: str | None = None

    # --- estimates -------------------------------------------------------------------------

    def alphas(self) -> list[float]:
        """Conditional acceptance alpha_1..alpha_kmax, unobserved ones extrapolated.

        Before any observation: 0.8 decaying by 0.9 per position (spec §4.2). Past the last observed
        position the estimate is carried flat (optimistic), so that a longer draft gets tried once
        and measured instead of being ruled out by an assumed decay forever (censoring)."""
        out, prev, seen = [], ALPHA_PRIOR / ALPHA_DECAY, False
        for j in range(1, self.k_max + 1):
            a = self.alpha[j]
            if a is not None:
                prev, seen = a, True
            elif not seen:
                prev = prev * ALPHA_DECAY
            out.append(prev)
        return out

    def acceptance(self) -> list[float]:
        """r_1..r_kmax: probability that a round accepts at least j drafts."""
        r, acc = [], 1.0
        for a in self.alphas():
            acc *= a
            r.append(acc)
        return r

    def expected_tokens(self, k: int) -> float:
        return 1.0 + sum(self.acceptance()[:k])

    def verify_cost(self, n: int) -> float:
        """V(n): measured, interpolated between measured sizes (a plain step standing for n = 1), or
        extrapolated past the largest measured size with the slope of the measured verifications alone.
        A plain step is not on their line: a verification also keeps per-step states and on CPU costs a
        fixed amount more (demo model: V(1) 0.61 ms, V(3) 1.20, V(4) 1.24, V(5) 1.33), so a line through
        the plain step overrates larger k and held `auto` at k = 2 where k = 4 was fastest."""
        assert self.t_plain is not None
        if n in self.t_verify:
            return self.t_verify[n]
        pts = sorted([(1, self.t_plain), *self.t_verify.items()])
        lo = [p for p in pts if p[0] < n]
        hi = [p for p in pts if p[0] > n]
        if lo and hi:
            (x0, y0), (x1, y1) = lo[-1], hi[0]
            return y0 + (y1 - y0) * (n - x0) / (x1 - x0)
        ver = sorted(self.t_verify.items())
        prior = PRIOR_VERIFY_SLOPE * self.t_plain
        if len(ver) >= 2:
            mx = sum(x for x, _ in ver) / len(ver)
            my = sum(y for _, y in ver) / len(ver)
            sxx = sum((x - mx) ** 2 for x, _ in ver)
            slope = max(0.0, sum((x - mx) * (y - my) for x, y in ver) / sxx)
        elif ver:   # one measured size: the prior slope, at most the chord from the plain step
            (x1, y1), = ver
            slope = min(prior, max(0.0, (y1 - self.t_plain) / (x1 - 1)))
        else:
            return self.t_plain + prior * (n - 1)
        x_last, y_last = lo[-1]
        return y_last + slope * (n - x_last)

    def round_cost(self, k: int) -> float:
        """T_k, spec §4.1; T_0 = the measured plain step (V(1) + U(1))."""
        assert self.t_plain is not None
        if k == 0:
            return self.t_plain
        d = self.t_draft if self.t_draft is not None else PRIOR_DRAFT * self.t_plain
        if k in self.t_post:
            post = self.t_post[k]
        elif self.t_post:
            post = self.t_post[min(self.t_post, key=lambda m: abs(m - k))]
        else:
            post = PRIOR_POST * self.t_plain
        return d * k + self.verify_cost(k + 1) + post

    def rate(self, k: int) -> float:
        """Predicted tokens per second of a round with k drafts."""
        return self.expected_tokens(k) / self.round_cost(k)

    def best_k(self, k_cap: int) -> int:
        cands = range(0, min(self.k_max, k_cap) + 1)
        return max(cands, key=lambda k: (self.rate(k), -k))

    @property
    def baseline_tps(self) -> float:
        return 1.0 / self.t_plain if self.t_plain else 0.0

    @property
    def state(self) -> str:  # type: ignore[override]
        if self.t_plain is None or self.calibration_seen < CALIBRATION_STEPS:
            return CALIBRATING
        return DISABLED if self.off else AUTO

    def new_request(self) -> None:
        """Keep the learned acceptance and times, and the count of plain steps towards the next probe:
        a slot that serves replies shorter than the probe interval (or its floor, up to PROBE_MAX plain
        steps after one slow round) must still probe now and then, or one bad estimate keeps MTP off on
        it for good. The new request's first probe waits for PROBE_SETTLE of its plain steps."""
        self.plain_in_request = 0
        self._probing = False

    # --- decisions -------------------------------------------------------------------------

    def decide(self, k_cap: int) -> Decision:
        if self.state == CALIBRATING or k_cap <= 0:
            return Decision(0, "plain", self.baseline_tps)
        if self.off:
            if self._probe_due():
                self._probing = True
                k = min(PROBE_K, k_cap, self.k_max)
                return Decision(k, "probe", self.rate(k))
            return Decision(0, "plain", self.baseline_tps)
        if self._streak > 0:
            self._streak -= 1
            return Decision(0, "plain", self.baseline_tps)
        if self.k_current > 0 and self.rounds_since_plain >= PLAIN_CHECK_EVERY:
            # re-measure T_0 where it is cheapest to be wrong about: a few plain steps in a row
            self.rounds_since_plain, self._streak = 0, PLAIN_STREAK - 1
            return Decision(0, "plain", self.baseline_tps)
        best = self.best_k(self.k_max)
        cur = self.k_current
        # between draft lengths 3 % hysteresis; turning MTP off needs a clear loss (OFF_HYSTERESIS),
        # because coming back costs probes and a noisy acceptance estimate crosses a thin margin often
        need = OFF_HYSTERESIS if best == 0 else HYSTERESIS
        if cur == 0 or self.rate(best) >= need * self.rate(cur):
            cur = best
        if cur == 0:
            self.off, self.plain_since_off, self.k_current, self._floor = True, 0, 0, None
            self._change = REASON_OFF
            return Decision(0, "plain", self.baseline_tps)
        self.k_current = cur
        k = min(cur, k_cap)
        self.rounds_since_explore += 1
        self.rounds_since_plain += 1
        if self.rounds_since_explore >= EXPLORE_EVERY and k == cur < min(self.k_max, k_cap):
            # acceptance past the chosen k is never observed at that k (censored): draft one more
            # now and then so a stale low estimate of alpha_{k+1} can recover
            self.rounds_since_explore = 0
            k += 1
        return Decision(k, "round", self.rate(k))

    def _probe_due(self) -> bool:
        """Whether the plain steps since MTP went off (or since the last probe) reached the probe schedule
        and the floor. The floor is computed once per off period, at the first step where it can matter:
        it prices a round from the estimates, ~2 us of Python, which every plain step paid while MTP was off
        (a demo-model step is ~450 us)."""
        if self.plain_since_off < self.probe_every or self.plain_in_request < PROBE_SETTLE:
            return False
        if self._floor is None:
            self._floor = self._probe_floor()
        return self.plain_since_off >= self._floor

    def _probe_floor(self) -> int:
        """Plain steps between probes so that the predicted loss of a lost probe (its time minus the
        time plain steps take for the tokens it yields) stays within PROBE_BUDGET of the decode time.
        spec §4.2's 16-doubling schedule applies above this floor."""
        k = min(PROBE_K, self.k_max)
        loss = self.round_cost(k) / self.round_cost(0) - self.expected_tokens(k)
        return min(PROBE_MAX, max(0, int(loss / PROBE_BUDGET)))

    def observe_plain(self, step_s: float) -> None:
        """step_s 0: a step not timed (`RoundTiming.timed`), counted towards probes but not calibration."""
        self.plain_in_request += 1
        if self.off:
            self.plain_since_off += 1
        if step_s <= 0:
            return
        was_calibrating = self.state == CALIBRATING
        self.calibration_seen += 1
        if self.calibration_seen > 1:   # the first step of a fresh policy carries one-time costs
            self._plain_times.append(step_s)
            self.t_plain = _lower_quartile(self._plain_times)
        if was_calibrating and self.state != CALIBRATING:
            self._change = REASON_BASELINE

    def observe_round(self, k: int, accepted: int, timing: RoundTiming) -> None:
        if k <= 0:
            return
        surprise = self._probing and accepted > 0 and (min(self.alphas()[:accepted]) < SURPRISE
                                                       or self.acceptance()[accepted - 1] < SURPRISE_PREFIX)
        if surprise:
            # a probe accepted drafts the estimate said were near-hopeless, or a prefix it gave little chance:
            # the text changed (prose -> code, or a poor request -> a good one on a slot that keeps its
            # estimates); restart the warm-up weights so the new regime is learnt in a few rounds. Not on any
            # probe that accepts its whole draft: where drafts are poor but not hopeless (random-token prompts,
            # demo model: conditional acceptance 0.53 / 0.70 / 0.86) one probe in three of k = 2 does, and each
            # such restart bought rounds that lost to plain steps (`on` k = 3 ran at 0.79-0.92x there)
            self.alpha_n = [0] * (self.k_max + 1)
        # alpha_j is observed by rounds with k >= j whose drafts 1..j-1 were accepted (spec §4.2)
        for j in range(1, min(k, accepted + 1) + 1):
            hit = 1.0 if j <= accepted else 0.0
            self.alpha_n[j] += 1
            # the prior counts as PRIOR_WEIGHT observations, then a fixed EMA weight of 0.1
            w = max(ALPHA_EMA, 1.0 / (self.alpha_n[j] + PRIOR_WEIGHT))
            prior = self.alpha[j] if self.alpha[j] is not None else self.alphas()[j - 1]
            self.alpha[j] = w * hit + (1.0 - w) * prior
        if timing.timed:   # a round with a compile (or an eager call beside one) teaches acceptance only
            self.t_draft = _ema(self.t_draft, timing.draft_s / k, TIME_EMA)
            times = self._verify_times.setdefault(k + 1, deque(maxlen=VERIFY_WINDOW))
            times.append(timing.verify_s)
            self.t_verify[k + 1] = _lower_quartile(times)
            self.t_post[k] = _ema(self.t_post.get(k), timing.post_s, TIME_EMA)
        if self._probing:
            self._probing = False
            self.plain_since_off, self._floor = 0, None
            best = self.best_k(self.k_max)
            if best > 0 and self.rate(best) >= HYSTERESIS * self.rate(0):
                self.off, self.k_current, self.probe_every = False, best, PROBE_FIRST
                self._change = REASON_PROBE_WON
            else:
                # look again soon after a probe that was a sign of change, or that accepted its whole draft
                # and left MTP within OFF_HYSTERESIS of plain steps (the loss that turned it off may have been
                # the estimates' noise); double the interval after the others, such as the full accepts of a
                # poor request (a third of them at the demo's 0.53 / 0.70 conditional acceptance)
                mtp = max(self.rate(j) for j in range(1, self.k_max + 1))
                near = accepted >= k and OFF_HYSTERESIS * mtp >= self.rate(0)
                self.probe_every = PROBE_FIRST if surprise or near else min(2 * self.probe_every, PROBE_MAX)
                self._change = REASON_PROBE_LOST
