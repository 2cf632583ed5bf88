"""TEST DOUBLE of the Executor protocol (never used outside tests).

It mirrors sequences from the plans exactly as the wire contract says (tokens, computed counts,
released ids, accepted speculative drafts) and "samples" a deterministic token: (last known token + 1) %
vocab; a sequence with drafts gets the tokens a model with that rule would keep (each draft equal to its
predecessor + 1 is accepted, the first one that is not is replaced). It can be told to
fail at a given step, to check that failures end requests with finish_reason "error". ``submit`` runs
the step at once and ``wait`` hands back its result (or raises its failure), in submission order, as a
real executor does; a ``PENDING_TOKEN`` delta takes the token this executor sampled at its last step.
"""

from pagedray.workers.contract.wire import PENDING_TOKEN, SampledToken, StepResult


class FakeExecutor:
    def __init__(self, num_blocks, vocab=512, fail_at_step=None):
        self.num_blocks = num_blocks
        self.dtype = "float32"
        self.vocab = vocab
        self.fail_at_step = fail_at_step
        self.mirror = {}          # seq_id -> [tokens, num_computed]
        self.plans = []
        self.closed = False
        self.last_sampled = {}    # seq_id -> token sampled at the last step
        self.waited = 0           # results handed out by wait()

    def submit(self, plan):
        try:
            return "ok", self.execute(plan)
        except Exception as exc:  # noqa: BLE001 - handed back by wait(), as a real executor would
            return "error", exc

    def wait(self, handle):
        kind, value = handle
        self.waited += 1
        if kind == "error":
            raise value
        return value

    def execute(self, plan):
        self.plans.append(plan)
        if self.fail_at_step is not None and len(self.plans) - 1 >= self.fail_at_step:
            raise RuntimeError("simulated rank failure")
        for seq_id in plan.released_seq_ids:
            del self.mirror[seq_id]
        batch = []
        decodes = plan.decodes
        for seq_id, token in zip(decodes.seq_ids, decodes.token_ids):
            state = self.mirror[seq_id]
            if token == PENDING_TOKEN:
                assert seq_id in self.last_sampled, f"seq {seq_id}: PENDING without a last sample"
                token = self.last_sampled[seq_id]
            assert state[1] == len(state[0]), f"seq {seq_id}: a decode row of a sequence with uncomputed tokens"
            state[0].append(token)
            batch.append((seq_id, 1, []))
        for delta in plan.running:
            state = self.mirror[delta.seq_id]
            state[0] += delta.accepted_token_ids                 # drafts kept last step: computed already
            state[1] += len(delta.accepted_token_ids)
            token = delta.new_token_id
            if token == PENDING_TOKEN:
                assert delta.seq_id in self.last_sampled, f"seq {delta.seq_id}: PENDING without a last sample"
                token = self.last_sampled[delta.seq_id]
            if token is not None:
                state[0].append(token)
            batch.append((delta.seq_id, delta.num_scheduled_tokens, delta.draft_token_ids))
        for new in plan.new_seqs:
            assert new.seq_id not in self.mirror, f"seq {new.seq_id} sent in full twice"
            self.mirror[new.seq_id] = [new.prompt_token_ids + new.output_token_ids, new.num_computed_tokens]
            batch.append((new.seq_id, new.num_scheduled_tokens, new.draft_token_ids))
        sampled = []
        for seq_id, num, drafts in batch:
            state = self.mirror[seq_id]
            state[1] += num - len(drafts)
            assert state[1] <= len(state[0]), "scheduled past the known tokens"
            if state[1] == len(state[0]):
                last = state[0][-1]
                for draft in drafts:                              # verification, as workers/sampling/speculative.py
                    sampled.append(SampledToken(seq_id, (last + 1) % self.vocab))
                    if draft != (last + 1) % self.vocab:
                        break
                    last = draft
                else:
                    sampled.append(SampledToken(seq_id, (last + 1) % self.vocab))
        self.last_sampled = {token.seq_id: token.token_id for token in sampled}   # the last of each sequence
        return StepResult(step_id=plan.step_id, sampled=sampled)

    def check_health(self):
        pass

    def is_rank_failure(self, exc):
        return False

    def rebuild(self):
        raise RuntimeError("FakeExecutor has no TP group to rebuild")

    def shutdown(self):
        self.closed = True


class GatedFakeExecutor(FakeExecutor):
    """TEST DOUBLE: like FakeExecutor, but every step waits for ``gate`` (a threading.Event) to be set;
    ``entered`` is set when a step is waiting at the gate."""

    def __init__(self, num_blocks, **kwargs):
        import threading

        super().__init__(num_blocks, **kwargs)
        self.gate = threading.Event()
        self.entered = threading.Event()

    def execute(self, plan):
        self.entered.set()
        assert self.gate.wait(timeout=120), "test never opened the gate"
        return super().execute(plan)


class RankFailure(RuntimeError):
    """TEST DOUBLE's stand-in for a dead TP rank (the only failure RecoverableFakeExecutor calls curable)."""


class RecoverableFakeExecutor(FakeExecutor):
    """TEST DOUBLE: like FakeExecutor, but the steps listed in ``fail_at_steps`` (0-based plan count) raise
    RankFailure, and ``rebuild()`` replaces the "TP group": the mirror (KV contents) is wiped.
    ``rebuild_fails`` makes rebuild raise instead; ``hold`` (a threading.Event) keeps rebuild() running, after
    its ``rebuild_s``, until the test sets it."""

    def __init__(self, num_blocks, fail_at_steps=(), rebuild_fails=False, rebuild_s=0.0, hold=None, **kwargs):
        import threading

        super().__init__(num_blocks, **kwargs)
        self.fail_at_steps = set(fail_at_steps)
        self.rebuild_fails = rebuild_fails
        self.rebuild_s = rebuild_s           # how long rebuild() takes at least
        self.hold = hold
        self.rebuilding = threading.Event()  # set while rebuild() runs
        self.num_rebuilds = 0

    def execute(self, plan):
        if len(self.plans) in self.fail_at_steps:
            self.plans.append(plan)
            raise RankFailure(f"simulated dead rank at step {len(self.plans) - 1}")
        return super().execute(plan)

    @staticmethod
    def is_rank_failure(exc):
        return isinstance(exc, RankFailure)

    def rebuild(self):
        import time

        if self.rebuild_fails:
            raise RuntimeError("simulated rebuild failure")
        self.rebuilding.set()
        time.sleep(self.rebuild_s)
        if self.hold is not None:
            assert self.hold.wait(120), "hang guard: the test never released the rebuild"
        self.rebuilding.clear()
        self.num_rebuilds += 1
        self.mirror = {}
        self.last_sampled = {}


class SleepingFakeExecutor(FakeExecutor):
    """TEST DOUBLE: like FakeExecutor, but the step listed as ``sleep_at_step`` sleeps (a stalled rank)
    until ``wake`` (a threading.Event) is set or ``max_sleep_s`` passes; ``sleeping`` is set meanwhile."""

    def __init__(self, num_blocks, sleep_at_step, max_sleep_s=30.0, **kwargs):
        import threading

        super().__init__(num_blocks, **kwargs)
        self.sleep_at_step = sleep_at_step
        self.max_sleep_s = max_sleep_s
        self.wake = threading.Event()
        self.sleeping = threading.Event()

    def execute(self, plan):
        if len(self.plans) == self.sleep_at_step:
            self.sleeping.set()
            self.wake.wait(timeout=self.max_sleep_s)
        return super().execute(plan)


class FakeClock:
    """TEST DOUBLE of ``time.monotonic`` for AsyncEngine(clock=...): time moves only when told to, so
    step ages, the stall watchdog and drain deadlines do not depend on how loaded the machine is."""

    def __init__(self, start=1000.0):
        import threading

        self._now = start
        self._lock = threading.Lock()

    def __call__(self):
        with self._lock:
            return self._now

    def advance(self, seconds):
        with self._lock:
            self._now += seconds


class PacedFakeExecutor(FakeExecutor):
    """TEST DOUBLE: like FakeExecutor, but each step advances ``clock`` by ``step_s``; a step that would
    start at or after ``hold_at`` (a clock value, None: never) waits for ``release`` (a threading.Event).
    The first step waits for ``gate`` so that the test can read the clock before anything has run."""

    def __init__(self, num_blocks, clock, step_s=1.0, **kwargs):
        import threading

        super().__init__(num_blocks, **kwargs)
        self.clock, self.step_s = clock, step_s
        self.hold_at = None
        self.gate, self.entered = threading.Event(), threading.Event()
        self.release, self.holding = threading.Event(), threading.Event()

    def execute(self, plan):
        if not self.plans:
            self.entered.set()
            assert self.gate.wait(timeout=60), "test never opened the gate"
        if self.hold_at is not None and self.clock() >= self.hold_at:
            self.holding.set()
            assert self.release.wait(timeout=60), "test never released the held step"
        self.clock.advance(self.step_s)
        return super().execute(plan)
