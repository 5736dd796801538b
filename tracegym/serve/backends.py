"""Backends: who decodes a planned request. ``StepperBackend`` batches continuously over an
``HFEngine``; ``SerialBackend`` serves any other token engine one ``generate`` call at a time. Both
report each sampled token and each finished choice through the same two callbacks (called from a
worker thread), so the routes never know which one they talk to."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Callable, Protocol

from tracegym.engines.base import scores_prompts
from tracegym.serve.state import ServeLimits

if TYPE_CHECKING:
    from tracegym.serve.plan import RequestPlan

log = logging.getLogger(__name__)

# on_token(row, token, logprob, top_logprobs) -> True when the choice should stop here
Submit = Callable[[int, int, float, Any], bool]
# on_finish(row, finish_reason): "stop", "length" or "abort"
OnFinish = Callable[[int, str], None]


class Handle:
    """A submitted request; ``cancel()`` frees its rows (the client went away)."""

    def __init__(self, cancel: Callable[[], None]):
        self.cancel = cancel


class Backend(Protocol):
    top_logprobs: bool  # can return the top alternatives of each token
    logit_bias: bool  # takes a logit bias
    returns_logprobs: bool
    scores_prompts: bool  # has ``score`` (echo with log-probs)

    def score(self, prompt: list[int]) -> list[float]: ...

    def queued(self) -> int: ...

    def submit(self, plan: RequestPlan, stop_ids: frozenset[int], on_token: Submit, on_finish: OnFinish) -> Handle: ...

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


class StepperBackend:
    """Continuous batching over an ``HFEngine``'s model."""

    top_logprobs = True
    logit_bias = True
    returns_logprobs = True

    def __init__(self, engine: Any, limits: ServeLimits):
        from tracegym.engines.hf_stepper import HFStepper

        self.engine = engine
        self.stepper = HFStepper(lambda: engine.model, max_batch_size=limits.max_batch_size,
                                 pad_token_id=engine.pad_token_id).start()
        self.scores_prompts = scores_prompts(engine)
        self._scoring = threading.Lock()  # one prompt scored at a time: bounded memory

    def score(self, prompt: list[int]) -> list[float]:
        """The prompt's log-probs (``HFEngine.prompt_logprobs``). It runs beside the stepper's steps
        on the same eval-mode model: forward passes under inference mode share no state."""
        with self._scoring:
            return self.engine.prompt_logprobs([prompt])[0]

    def queued(self) -> int:
        return self.stepper.waiting_requests

    def submit(self, plan: RequestPlan, stop_ids: frozenset[int], on_token: Submit, on_finish: OnFinish) -> Handle:
        from tracegym.engines.hf_stepper import StepRequest

        p = plan.params
        request = StepRequest(
            prompt=plan.prompt, max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, n=p.n,
            seed=p.seed, stop_token_ids=stop_ids, top_logprobs=plan.top_logprobs, logit_bias=plan.logit_bias,
            on_token=on_token, on_finish=on_finish,
        )
        self.stepper.submit(request)
        return Handle(request.cancel)

    def stats(self) -> dict[str, Any]:
        s = self.stepper
        return {"active_rows": s.active_rows, "queued_requests": s.waiting_requests, "steps": s.steps,
                "max_active_rows": s.max_active_rows}

    def close(self) -> None:
        self.stepper.close()


class SerialBackend:
    """Any token engine: one ``generate`` call at a time, replayed as token events."""

    top_logprobs = False
    logit_bias = False

    def __init__(self, engine: Any):
        self.engine = engine
        self.lock = threading.Lock()  # held by the one ``generate`` (or ``score``) call running
        self.waiting = 0
        self._count = threading.Lock()
        caps = getattr(engine, "capabilities", None)
        self.returns_logprobs = bool(getattr(caps, "returns_logprobs", getattr(engine, "returns_logprobs", False)))
        self.scores_prompts = scores_prompts(engine)

    def score(self, prompt: list[int]) -> list[float]:
        """The prompt's log-probs (the engine's ``prompt_logprobs``), between ``generate`` calls."""
        with self.lock:
            return self.engine.prompt_logprobs([prompt])[0]

    def queued(self) -> int:
        return self.waiting

    def submit(self, plan: RequestPlan, stop_ids: frozenset[int], on_token: Submit, on_finish: OnFinish) -> Handle:
        cancelled = threading.Event()
        with self._count:
            self.waiting += 1
        threading.Thread(target=self._run, args=(plan, stop_ids, on_token, on_finish, cancelled), daemon=True,
                         name="tracegym-serve-call").start()
        return Handle(cancelled.set)

    def _run(self, plan: RequestPlan, stop_ids: frozenset[int], on_token: Submit, on_finish: OnFinish,
             cancelled: threading.Event) -> None:
        """The worker thread: wait for the engine, generate, replay the generations as events."""
        n = plan.params.n
        with self.lock:
            with self._count:
                self.waiting -= 1
            if cancelled.is_set():
                for i in range(n):
                    on_finish(i, "abort")
                return
            try:
                generations = self.engine.generate([plan.prompt], plan.params)[0]
            except Exception:  # noqa: BLE001 - reported to the client as a 500
                log.exception("serve: generation failed")
                for i in range(n):
                    on_finish(i, "abort")
                return
        for i, gen in enumerate(generations):
            on_finish(i, _replay(gen, i, stop_ids, on_token))

    def stats(self) -> dict[str, Any]:
        return {"queued_requests": self.waiting}

    def close(self) -> None:
        pass


def _replay(gen: Any, row: int, stop_ids: frozenset[int], on_token: Submit) -> str:
    """Report one finished generation's tokens as if they had been sampled one by one; the finish
    reason ("stop" when a stop string or stop id came before the engine's own end)."""
    lps = gen.logprobs or (0.0,) * len(gen.token_ids)
    for tok, lp in zip(gen.token_ids, lps):
        if on_token(row, int(tok), float(lp), None):
            return "stop"
        if tok in stop_ids:
            return "stop"
    return gen.finish_reason


def make_backend(engine: Any, limits: ServeLimits) -> Backend:
    """Continuous batching for an ``HFEngine``, one call at a time for anything else."""
    from tracegym.engines.hf import HFEngine

    if isinstance(engine, HFEngine):
        return StepperBackend(engine, limits)
    return SerialBackend(engine)
