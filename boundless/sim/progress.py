"""A progress bar over virtual time, on stderr: simulated seconds against the last arrival."""

from __future__ import annotations

import sys

from tqdm import tqdm


class VirtualTimeBar:
    """Shows how far a run's clock has got; the bar's end is the last program's arrival (programs still
    finish after it, so the count may pass the total). Updated at most once per simulated second."""

    def __init__(self, horizon_s: float, label: str, enabled: bool = True) -> None:
        self._bar = tqdm(
            total=max(1, round(horizon_s)), desc=label, unit="sim s", file=sys.stderr, disable=not enabled, leave=False
        )
        self._shown = 0

    def __call__(self, now: float) -> None:
        whole = int(now)
        if whole > self._shown:
            self._bar.update(whole - self._shown)
            self._shown = whole

    def close(self) -> None:
        self._bar.close()
