"""Passive health: the per-worker circuit breaker and the error-rate window for outlier ejection.

Both only count; the fleet decides what a transition means for routing (and
caps how much of the fleet outlier ejection may take out).
"""

from __future__ import annotations

import time
from collections import deque
from enum import StrEnum

from switchyard.balancer.settings import BalancerSettings


class Circuit(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class Breaker:
    """closed --N consecutive failures--> open --timeout--> half_open --successes--> closed.

    In half_open only ``cb_half_open_trials`` requests may be in flight at once; any
    failed trial re-opens the circuit for another timeout.
    """

    __slots__ = ("state", "failures", "opened_at", "trials", "trial_successes", "_s")

    def __init__(self, settings: BalancerSettings) -> None:
        self._s = settings
        self.state = Circuit.CLOSED
        self.failures = 0
        self.opened_at = 0.0
        self.trials = 0
        self.trial_successes = 0

    def admits(self, now: float) -> bool:
        """Whether a new request may go now (moves open to half_open once the timeout passed)."""
        if self.state is Circuit.CLOSED:
            return True
        if self.state is Circuit.OPEN:
            if now - self.opened_at < self._s.cb_open_timeout_s:
                return False
            self.state = Circuit.HALF_OPEN
            self.trials = 0
            self.trial_successes = 0
        return self.trials < self._s.cb_half_open_trials

    def on_begin(self) -> bool:
        """Count a request that starts now; returns True if it is a half-open trial."""
        if self.state is Circuit.HALF_OPEN:
            self.trials += 1
            return True
        return False

    def on_end(self, failed: bool, trial: bool, counted: bool = True) -> Circuit | None:
        """Record a finished request; returns the new state if it changed.

        ``counted`` False (client abort) only frees the trial slot.
        """
        if trial and self.trials > 0:
            self.trials -= 1
        if not counted:
            return None
        if not failed:
            self.failures = 0
            if trial and self.state is Circuit.HALF_OPEN:
                self.trial_successes += 1
                if self.trial_successes >= self._s.cb_success_threshold:
                    self._close()
                    return Circuit.CLOSED
            return None
        self.failures += 1
        if self.state is Circuit.HALF_OPEN and trial:
            self.trip()
            return Circuit.OPEN
        if self.state is Circuit.CLOSED and self.failures >= self._s.cb_failure_threshold:
            self.trip()
            return Circuit.OPEN
        return None

    def trip(self, now: float | None = None) -> None:
        self.state = Circuit.OPEN
        self.opened_at = time.monotonic() if now is None else now
        self.trials = 0
        self.trial_successes = 0

    def _close(self) -> None:
        self.state = Circuit.CLOSED
        self.failures = 0
        self.trials = 0
        self.trial_successes = 0


class OutlierWindow:
    """The last N outcomes of a worker, for its error rate."""

    __slots__ = ("_window", "errors")

    def __init__(self, size: int) -> None:
        self._window: deque[bool] = deque(maxlen=max(size, 1))
        self.errors = 0

    def record(self, failed: bool) -> None:
        if len(self._window) == self._window.maxlen and self._window[0]:
            self.errors -= 1
        self._window.append(failed)
        if failed:
            self.errors += 1

    def __len__(self) -> int:
        return len(self._window)

    @property
    def error_rate(self) -> float:
        return self.errors / len(self._window) if self._window else 0.0

    def clear(self) -> None:
        self._window.clear()
        self.errors = 0
