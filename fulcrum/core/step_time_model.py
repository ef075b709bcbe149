"""How long a step will take, learned online from the engine's own steps.

A step's time is close to linear in a few counts (Sarathi-Serve's and Niyama's deadline
schedulers use the same shape, with coefficients profiled offline): a fixed cost per step,
a cost per prefill token and per decode token (the weights' matrix work), a cost per unit of
attention work (a prefill chunk of c tokens after s cached ones attends c * (s + c / 2)
keys; a decode attends its whole context) and a cost per sequence. fulcrum fits the
coefficients by least squares with forgetting, so they follow the machine as it is now (a
noisy neighbour, a warmer cache) rather than as it was at start-up; a short profile of real
steps at start-up seeds them (see `LLMEngine._profile_step_time`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np

# Per-feature scales, so that every column of the regression is of order one.
_SCALES = np.array([1.0, 1e-3, 1e-2, 1e-6, 1e-4, 1e-2])
# Once warm, a step's surprise counts at most this share of its prediction (plus a little):
# one stalled step (a page-fault storm, a neighbour's burst) must not teach the model that
# every step is slow, while a lasting change still comes through over a few dozen steps.
_WARM_UPDATES = 16
_MAX_SURPRISE = 0.5
_MIN_SURPRISE_S = 2e-3
_UNANCHORED_RIDGE = 1e-9
# Once warm, the fit is solved every this many steps, and the steps seen since the last solve
# are folded into its sums then, at once: numpy right after a forward pass runs on caches
# the weights have just swept, where a fold and a solve take several hundred microseconds,
# most of a percent of a batch-1 decode step even every fourth step. The fit forgets over
# about fifty steps anyway: coefficients a dozen steps old change no decision.
_SOLVE_EVERY = 16


@dataclass
class StepShape:
    """What a step computes, in the counts the time model reads."""

    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_attention: float = 0.0  # sum over chunks of c * (start + c / 2)
    decode_context: int = 0  # sum of the decodes' context lengths
    num_seqs: int = 0

    def add_chunk(self, start: int, num_tokens: int) -> None:
        """A run of one request's tokens after `start` computed ones. A single token costs
        what a decode costs (one query over its context), so it counts as one."""
        if num_tokens == 1:
            self.add_decode(start + 1)
            return
        self.prefill_tokens += num_tokens
        self.prefill_attention += num_tokens * (start + num_tokens / 2)
        self.num_seqs += 1

    @classmethod
    def of_decodes(cls, contexts: List[int]) -> "StepShape":
        """A step of decodes alone, one per context length."""
        return cls(decode_tokens=len(contexts), decode_context=sum(contexts),
                   num_seqs=len(contexts))

    def add_decode(self, context: int) -> None:
        self.decode_tokens += 1
        self.decode_context += context
        self.num_seqs += 1

    def with_chunk(self, start: int, num_tokens: int) -> "StepShape":
        shape = StepShape(self.prefill_tokens, self.decode_tokens, self.prefill_attention,
                          self.decode_context, self.num_seqs)
        shape.add_chunk(start, num_tokens)
        return shape

    def features(self) -> Tuple[float, ...]:
        """The regression's inputs, unscaled; the first is the fixed cost's."""
        return (1.0, self.prefill_tokens, self.decode_tokens, self.prefill_attention,
                self.decode_context, self.num_seqs)

    @property
    def is_empty(self) -> bool:
        return self.num_seqs == 0


class StepTimeModel:
    """Least squares over `StepShape` features, recent steps weighed more; times in seconds.

    With `forgetting` 0.98 the fit is dominated by about the last fifty steps. Long runs of
    alike steps (a few requests decoding, hundreds of steps) say nothing about the other
    directions, and plain recursive least squares lets them drift there: the real step time
    is not exactly linear, and its small misfit, pushed through the correlations, once drove
    the predicted cost of a prompt to zero. So the fit is regularised (`ridge`) towards the
    coefficients of the start-up profile (`anchor_here`): directions the recent steps do not
    excite stay where the profile put them, while those they do excite follow the data.
    Until it has seen a step the model predicts zero.
    """

    def __init__(self, forgetting: float = 0.98, ridge: float = 1e-3) -> None:
        self.forgetting = forgetting
        self.ridge = ridge
        self.reset()

    def reset(self) -> None:
        size = len(_SCALES)
        self.theta = np.zeros(size)
        self.anchor: Optional[np.ndarray] = None  # what the fit is regularised towards
        self.gram = np.zeros((size, size))  # sum of weighted x x^T
        self.moment = np.zeros(size)  # sum of weighted x y
        # Steps not yet in the sums: (unscaled features, the time they are fitted to).
        self._pending: List[Tuple[Tuple[float, ...], float]] = []
        self.num_updates = 0
        self.last_error = 0.0  # actual - predicted, of the last step seen
        # The coefficients per unscaled feature as floats: predictions run in the scheduler,
        # several per step, and plain arithmetic is ten times cheaper than numpy there.
        self.coefficients: Tuple[float, ...] = (0.0,) * size

    def predict(self, shape: StepShape) -> float:
        if shape.is_empty:
            return 0.0
        c = self.coefficients
        return max(c[0] + c[1] * shape.prefill_tokens + c[2] * shape.decode_tokens
                   + c[3] * shape.prefill_attention + c[4] * shape.decode_context
                   + c[5] * shape.num_seqs, 0.0)

    def prefill_seconds(self, start: int, num_tokens: int) -> float:
        """Predicted time of a step that computes only this prompt chunk."""
        c = self.coefficients
        return max(c[0] + c[1] * num_tokens + c[3] * num_tokens * (start + num_tokens / 2)
                   + c[5], 0.0)

    def update(self, shape: StepShape, seconds: float) -> None:
        if shape.is_empty:
            return
        features = shape.features()
        # The fit's own prediction, unclamped; its coefficients are those of the last solve.
        predicted = sum(c * f for c, f in zip(self.coefficients, features))
        self.last_error = error = seconds - predicted
        if self.num_updates >= _WARM_UPDATES:
            bound = _MAX_SURPRISE * max(predicted, 0.0) + _MIN_SURPRISE_S
            error = min(max(error, -bound), bound)
        self._pending.append((features, predicted + error))
        self.num_updates += 1
        if self.num_updates <= _WARM_UPDATES or self.num_updates % _SOLVE_EVERY == 0:
            self._solve()

    def _fold(self) -> None:
        """Add the pending steps to the sums, each weighed as if added on its own step."""
        if not self._pending:
            return
        x = np.array([f for f, _ in self._pending]) * _SCALES
        y = np.array([t for _, t in self._pending])
        weights = self.forgetting ** np.arange(len(y) - 1, -1, -1)
        decay = self.forgetting ** len(y)
        self.gram = decay * self.gram + (x * weights[:, None]).T @ x
        self.moment = decay * self.moment + x.T @ (weights * y)
        self._pending = []

    def _solve(self) -> None:
        self._fold()
        # Before an anchor is set, a token ridge only keeps the system solvable.
        ridge, anchor = (_UNANCHORED_RIDGE, 0.0) if self.anchor is None else \
            (self.ridge, self.anchor)
        self.theta = np.linalg.solve(self.gram + ridge * np.eye(len(self.theta)),
                                     self.moment + ridge * anchor)
        self.coefficients = tuple(float(v) for v in self.theta * _SCALES)

    def fit(self, shapes: List[StepShape], seconds: List[float]) -> None:
        """Seed the model with observed steps (the start-up profile); later fits are
        regularised towards the coefficients found here."""
        for shape, actual in zip(shapes, seconds):
            self.update(shape, actual)
        self.anchor_here()

    def anchor_here(self) -> None:
        """Regularise later fits towards the coefficients that every step seen so far
        gives."""
        if self.num_updates:
            self._solve()
        self.anchor = self.theta.copy()
