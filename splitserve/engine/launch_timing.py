"""When to launch the next step under async scheduling.

With async scheduling the core launches step N+1 while step N runs on the device, so the host's work
hides behind the device's. Launched at once, though, N+1's batch is fixed for all of N's run time: a
request that arrives meanwhile waits for N, then N+1, and only joins N+2 — a whole step (8 ms of
decode, 30 ms of a prompt) added to its time to first token. Launched too late, the device idles.

So the core launches N+1 as late as it safely can: when N is expected to end, less the host time a
launch takes and a margin. N's device time is predicted from the device times of earlier steps of
the same shape (CUDA events), and the launch time from earlier launches. A shape never seen, or a
device without events, launches at once, as before. Until the deadline the core loop keeps reading
its input, so what arrives joins N+1.
"""
from __future__ import annotations


def step_shape(num_tokens: int, pure_decode: bool) -> tuple[bool, int]:
    """The key steps of similar device time share: decode or not, and the token count rounded up to
    a power of two (decode steps of 17..32 sequences replay similar graphs; prompt time grows with
    tokens)."""
    return pure_decode, 1 << max(0, num_tokens - 1).bit_length()


class LaunchTimer:
    def __init__(self, margin_s: float = 0.0007, smoothing: float = 0.25, min_step_s: float = 0.003):
        self.margin_s = margin_s
        self.smoothing = smoothing
        self.min_step_s = min_step_s  # shorter steps: too little to win, too easy to starve the device
        self._device_s: dict[tuple[bool, int], float] = {}
        self._launch_s: float | None = None

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.smoothing * (new - old)

    def observe_device(self, shape: tuple[bool, int], seconds: float) -> None:
        self._device_s[shape] = self._ema(self._device_s.get(shape), seconds)

    def observe_launch(self, seconds: float) -> None:
        # The slowest recent launch matters (a late launch starves the device): rise at once, decay slowly.
        self._launch_s = seconds if self._launch_s is None or seconds > self._launch_s else \
            self._ema(self._launch_s, seconds)

    def deadline(self, started_at: float, shape: tuple[bool, int]) -> float | None:
        """When to launch the step after the one of `shape` that began on the device at `started_at`
        (monotonic seconds); None: at once."""
        expected = self._device_s.get(shape)
        if expected is None or self._launch_s is None or expected < self.min_step_s:
            return None
        return started_at + expected - self._launch_s - self.margin_s
