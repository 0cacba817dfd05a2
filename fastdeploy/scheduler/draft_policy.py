"""How many draft tokens a decode step may verify, chosen from what steps were measured to yield.

Speculation pays when the device has room: one verify pass of B rows x (k + 1) tokens costs
about what a decode step costs, and yields more than one token per row. A busy server has no
room left (and a verify shape may lose what a decode shape has, such as a captured CUDA
graph), so the same drafts that double a lone request's speed can halve a full batch's.
Neither the step cost nor the acceptance is known in advance, and both change with the
model, the device, the batch and the text, so each is measured instead of modelled.

For every batch-size class (powers of two of the running sequences) the policy keeps, per
draft cap k (0, 1, 2, 4, ... up to the configured number), a moving average of the tokens
per sequence per second that pure-decode steps with that cap produced (per sequence, so that
steps of 40 and of 60 rows in one class compare fairly where a step's time hardly depends on
its rows, as on a GPU). A step takes the cap with the best average; the caps next to it are
tried again now and then, the less often the more a try costs (about 0.4 % of the throughput
per cap), so a change in the load or the text is still followed, one cap at a time.

With asynchronous scheduling a step without drafts is sent ahead of the running one when the
next has none either, so a run of them costs less per step than one such step between drafted
steps, which goes in turn. Cap 0 is therefore tried as a run of steps, its figures are those of
the steps sent ahead (the in-turn ones are kept apart), and trying a drafting cap while cap 0 is
the best also pays for the in-turn step it forces (under tensor parallelism; on one GPU the
worker drafts on the device and steps with drafts go ahead too, so no step goes in turn to count).
A step's time is measured from the frame before it to its own, so it holds the launch of the
step sent after it; the last step of a run without drafts thus holds a verify step's launch and
the drafting for it, which are charged to that verify step instead (`observe`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Sequence-steps of each end cap (none, all) before its figures are trusted: one step of a
# batch, four of a lone request. One row's yield ranges from 1 to k + 1 tokens: from two of
# them, drafts that pay 1.6x looked like a loss in 1 of 16 simulated lone requests, and the wait
# before the next try (the longer the worse a cap looks) kept them off for the whole request.
MIN_ROWS = 4
# A sample's weight decays by this factor per sequence of the cap's later samples: a cap's
# figures are those of its last few hundred sequence-steps, a handful of steps of a full batch
# (quick to follow a change) or a few hundred of a lone request (whose one-row steps yield
# anything from 1 to k + 1 tokens: a few of them say little).
ROW_DECAY = 0.995
# A retry of a worse cap may cost at most this fraction of the throughput: its wait grows with
# what it loses (the cap's step time over the best's, times how far its yield trails).
RETRY_COST = 0.004
# ... but a cap that loses almost nothing is still not retried more often than this.
MIN_RETRY_STEPS = 32
# A sample counts as at most this many of the cap's usual steps.
OUTLIER_FACTOR = 2.0
# A cap whose figures could still be the best's (its yield plus this many standard errors of a
# figure from `rows` rows, about 1 / sqrt(rows) relative: one row's yield varies about as much
# as it is) is retried after only a few steps, until enough rows say otherwise. Half a standard
# error: more retries lost more than the better picks gained in simulated runs.
CONFIDENCE = 0.5
PLAUSIBLE_RETRY_STEPS = 4
# With asynchronous scheduling, cap 0 is taken for at least this many steps at a time: all but
# the first are sent ahead, so a try measures what the cap gives when it is chosen.
ZERO_RUN_STEPS = 4


@dataclass
class FixedDraftCap:
    """`"adaptive": false`: every step may verify the configured number of drafts. Shares the
    policy's interface so that the engine sends such steps ahead alike (on one GPU the worker
    drafts on the device), instead of running them in turn for a host-side proposer."""

    num_speculative_tokens: int

    def cap(self, num_rows: int) -> int:
        return self.num_speculative_tokens

    def observe(self, num_rows: int, cap: int, num_tokens: int, seconds: float, sent_ahead: bool = False,
                drafted_next: bool = False) -> None:
        """Nothing is measured: the cap does not change."""

    def describe(self) -> str:
        return f"fixed at {self.num_speculative_tokens}"

    def details(self) -> dict[str, dict]:
        return {}


def draft_caps(num_speculative_tokens: int) -> list[int]:
    """The caps tried: no drafts, powers of two below the configured number, and that number."""
    caps = [0]
    k = 1
    while k < num_speculative_tokens:
        caps.append(k)
        k *= 2
    return caps + [num_speculative_tokens]


@dataclass
class _Arm:
    """One cap's decayed sums over its pure-decode steps."""

    tokens_per_row: float = 0.0
    seconds: float = 0.0
    weight: float = 0.0  # of the samples, decayed alike
    rows: float = 0.0  # sequences the samples covered, decayed alike
    seen_rows: int = 0  # sequences the samples covered, not decayed
    warmed: bool = False  # the cap's first step in its class, not counted, has run
    last_step: int = 0  # the class's step count when this cap last ran
    pipelined: bool = False  # cap 0: its figures are those of steps sent ahead
    steps_seen: int = 0  # the steps observed under this cap (the warm-up step not counted)
    steps_ahead: int = 0  # of those, the ones sent ahead of the step before them

    @property
    def rate(self) -> float:
        """Tokens per sequence per second."""
        return self.tokens_per_row / self.seconds if self.seconds > 0 else 0.0

    @property
    def step_seconds(self) -> float:
        return self.seconds / self.weight if self.weight > 0 else 0.0


@dataclass
class _BatchClass:
    arms: dict[int, _Arm]
    steps: int = 0
    # Steps without drafts that went in turn, where others are sent ahead: apart from cap 0's
    # figures (which, once any step was sent ahead, are those of the steps sent ahead).
    zero_in_turn: _Arm = field(default_factory=_Arm)
    # Steps without drafts right after a step with drafts (a switch), kept for `details` only:
    # they count in cap 0's figures like any other of its steps.
    zero_after_drafts: _Arm = field(default_factory=_Arm)
    # Steps without drafts that also drafted for the step after them, as measured (for `details`;
    # see `observe` for what cap 0's figures take of them).
    zero_before_drafts: _Arm = field(default_factory=_Arm)
    last_cap: int = 0  # the cap of the class's last observed step
    # The caps measured first: both ends, all drafts before none (where drafts pay, a lone
    # request, the first steps do too); or one cap that measured classes point to (a server's
    # batch drifts through several classes as requests come and go, and trying a bad end in
    # each costs a short run more than it learns). See DraftPolicy._first_caps.
    first: tuple[int, ...] = ()


@dataclass
class DraftPolicy:
    """Per step: `cap(num_rows)` before scheduling, `observe(...)` once the step's tokens are in."""

    num_speculative_tokens: int
    # Steps without drafts can be sent ahead of the running one (asynchronous scheduling).
    pipelined_zero: bool = False
    classes: dict[int, _BatchClass] = field(default_factory=dict)
    _zero_run: tuple[int, int] = (0, 0)  # (class, steps left) of the run of cap 0 under way
    _observed: int = 0  # steps observed, every class
    # (class, `_observed` then, seconds) of the last step without drafts that held a verify
    # step's launch: the seconds go to that verify step if it is the next one observed.
    _carried: tuple[int, int, float] = (0, 0, 0.0)

    def cap(self, num_rows: int) -> int:
        """The most drafts any sequence gets in a step of about `num_rows` decoding sequences."""
        key = _class_key(num_rows)
        run_class, run_left = self._zero_run
        if run_left > 0 and run_class == key:
            self._zero_run = (key, run_left - 1)
            return 0
        k = self._pick(key)
        self._zero_run = (key, ZERO_RUN_STEPS - 1) if k == 0 and self.pipelined_zero else (0, 0)
        return k

    def _pick(self, key: int) -> int:
        group = self._group(key)
        arms = group.arms
        caps = sorted(arms)
        # The caps between the ends are tried later as neighbours of the best (the yield over
        # the caps is taken to have one peak), so a short run pays for two trials at most.
        for k in group.first:
            if arms[k].seen_rows < MIN_ROWS:
                return k
        best_cap = _best_measured(group)
        assert best_cap is not None, "the first caps are measured"
        best = arms[best_cap]
        i = caps.index(best_cap)
        overdue: list[tuple[float, int]] = []
        # The neighbours, and the ends: an end that one bad sample made look poor must still
        # come back without a climb through every cap between.
        for k in sorted(set(caps[max(0, i - 1):i + 2]) | {caps[0], caps[-1]}):
            arm = arms[k]
            if arm is best:
                continue
            if arm.rows == 0:
                wait = float(MIN_RETRY_STEPS)
            elif arm.rate * (1.0 + CONFIDENCE / arm.rows ** 0.5) >= best.rate:
                wait = PLAUSIBLE_RETRY_STEPS
            else:
                # Throughput a retry of this cap loses, as a fraction of one best step's.
                loss = arm.step_seconds / best.step_seconds * (1.0 - arm.rate / best.rate)
                if k == 0 and self.pipelined_zero:
                    loss *= ZERO_RUN_STEPS  # tried as a run
                elif best_cap == 0 and group.zero_in_turn.weight > 0:
                    # The step before it cannot be sent ahead of it: it goes in turn.
                    loss += max(0.0, group.zero_in_turn.step_seconds / best.step_seconds - 1.0)
                wait = max(MIN_RETRY_STEPS, loss / RETRY_COST)
            overdue.append((group.steps - arm.last_step - wait, k))
        due, k = max(overdue, default=(-1.0, best_cap))
        return k if due >= 0 else best_cap

    def observe(self, num_rows: int, cap: int, num_tokens: int, seconds: float, sent_ahead: bool = False,
                drafted_next: bool = False) -> None:
        """A pure-decode step of `num_rows` sequences under `cap` produced `num_tokens` in `seconds`;
        `sent_ahead`: it was sent while the step before it ran; `drafted_next`: the step after
        it takes drafts."""
        if seconds <= 0 or num_rows <= 0:
            return
        key = _class_key(num_rows)
        group = self._group(key)
        arm = group.arms.get(cap)
        if arm is None:
            return
        self._observed += 1
        carried_class, carried_at, carried_s = self._carried
        self._carried = (0, 0, 0.0)
        group.steps += 1
        arm.last_step = group.steps
        switched, group.last_cap = cap == 0 and group.last_cap > 0, cap
        if cap == 0 and drafted_next:
            # A step's time runs from the frame before it to its own, so it holds the launch of
            # the step sent after it: here a verify step's (the drafts placed, a sampling row per
            # draft slot), and the drafting for it (an n-gram lookup, the MTP module's passes).
            # What that took beyond cap 0's usual step is charged to the verify step, whose cap
            # pays it in every step when chosen. Left here, it made the runs without drafts look
            # dearer than they are when chosen (about 2.3x a step at 64 sequences: the last of
            # each run of four took 5.8 ms against 2.0).
            _add(group.zero_before_drafts, num_rows, num_tokens, seconds)
            usual = arm.step_seconds if arm.weight > 0 else seconds
            extra = max(0.0, seconds - usual)
            seconds -= extra
            self._carried = (key, self._observed, extra)
        elif cap > 0 and carried_class == key and carried_at == self._observed - 1:
            # The verify step it launched, observed next in the same class (a step in between
            # that was not observed, or a change of class, drops the charge: it is not known
            # to be this step's).
            seconds += carried_s
        if not arm.warmed:
            # A cap's first step in a class can run shapes nothing ran before (a kernel compiles,
            # a buffer grows): it measures that, not the cap.
            arm.warmed = True
            return
        arm.steps_seen += 1
        arm.steps_ahead += sent_ahead
        if switched:
            _add(group.zero_after_drafts, num_rows, num_tokens, seconds)
        if cap == 0 and self.pipelined_zero:
            if not sent_ahead:
                _add(group.zero_in_turn, num_rows, num_tokens, seconds)
                if arm.pipelined:
                    return  # cap 0's figures are those of its steps sent ahead
            elif not arm.pipelined:
                # The first step sent ahead: the in-turn ones measured the cap as it runs between
                # drafted steps, not as it runs when chosen.
                group.arms[0] = arm = _Arm(warmed=True, last_step=arm.last_step, pipelined=True,
                                           steps_seen=arm.steps_seen, steps_ahead=arm.steps_ahead)
        _add(arm, num_rows, num_tokens, seconds)

    def describe(self) -> str:
        """Per batch-size class: the cap steps take now, and each measured cap's tokens per
        sequence per second (for the engine's stats line)."""
        parts = []
        for key in sorted(self.classes):
            group = self.classes[key]
            best = _best_measured(group)
            if best is None:
                continue
            rows = _class_rows(key)
            rates = ", ".join(f"{k}: {arm.rate:.0f}" for k, arm in sorted(group.arms.items()) if arm.rows > 0)
            parts.append(f"{rows} seqs -> {best} ({rates})")
        return "; ".join(parts) or "none measured yet"

    def details(self) -> dict[str, dict]:
        """Per batch-size class, what each cap was measured at: tokens per sequence per second,
        seconds a step, steps seen and how many of them were sent ahead (benchmarks record this
        beside their speed-ups: a cap that looks slow only in turn shows here)."""
        out: dict[str, dict] = {}
        for key in sorted(self.classes):
            group = self.classes[key]
            caps = {str(k): {"rate": round(arm.rate, 1), "step_ms": round(1e3 * arm.step_seconds, 3),
                             "steps": arm.steps_seen, "sent_ahead": arm.steps_ahead}
                    for k, arm in sorted(group.arms.items()) if arm.steps_seen}
            out[_class_rows(key)] = {"best": _best_measured(group), "caps": caps,
                                   "zero_in_turn_step_ms": _step_ms(group.zero_in_turn),
                                   "zero_after_drafts_step_ms": _step_ms(group.zero_after_drafts),
                                   "zero_before_drafts_step_ms": _step_ms(group.zero_before_drafts)}
        return out

    def _first_caps(self, key: int, caps: list[int]) -> tuple[int, ...]:
        """The caps a new class measures first: the best of a measured neighbouring class; else
        none where a smaller batch already did best with none, all where a larger one did best
        with all (drafts pay less as the batch grows); else both ends, all drafts first."""
        best: dict[int, int] = {}
        for k, g in self.classes.items():
            cap = _best_measured(g)
            if k != key and cap is not None:
                best[k] = cap
        for near in (key - 1, key + 1):
            if near in best:
                return (best[near],)
        smaller = [k for k in best if k < key]
        if smaller and best[max(smaller)] == caps[0]:
            return (caps[0],)
        larger = [k for k in best if k > key]
        if larger and best[min(larger)] == caps[-1]:
            return (caps[-1],)
        return (caps[-1], caps[0])

    def _group(self, key: int) -> _BatchClass:
        group = self.classes.get(key)
        if group is None:
            caps = draft_caps(self.num_speculative_tokens)
            group = self.classes[key] = _BatchClass({k: _Arm() for k in caps}, first=self._first_caps(key, caps))
        return group


def _class_key(num_rows: int) -> int:
    return max(1, num_rows).bit_length()  # 1, 2-3, 4-7, 8-15, ...


def _class_rows(key: int) -> str:
    """The running sequences of class `key`: "1", "2-3", "4-7", ..."""
    low, high = 1 << (key - 1), (1 << key) - 1
    return str(low) if low == high else f"{low}-{high}"


def _add(arm: _Arm, num_rows: int, num_tokens: int, seconds: float) -> None:
    """One step's sample into `arm`'s decayed sums."""
    if arm.weight > 0:
        # One step slowed by something else (a collection, a busy neighbour) must not sink a
        # cap for long: no sample counts as more than a few of the cap's usual steps.
        seconds = min(seconds, OUTLIER_FACTOR * arm.step_seconds)
    decay = ROW_DECAY ** num_rows
    arm.tokens_per_row = arm.tokens_per_row * decay + num_tokens / num_rows
    arm.seconds = arm.seconds * decay + seconds
    arm.weight = arm.weight * decay + 1.0
    arm.rows = arm.rows * decay + num_rows
    arm.seen_rows += num_rows


def _step_ms(arm: _Arm) -> float | None:
    return round(1e3 * arm.step_seconds, 3) if arm.weight else None


def _best_measured(group: _BatchClass) -> int | None:
    """The class's cap with the best measured yield (None before any is measured)."""
    measured = [k for k, arm in group.arms.items() if arm.rows > 0]
    return max(measured, key=lambda k: group.arms[k].rate) if measured else None
