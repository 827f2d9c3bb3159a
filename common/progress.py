"""Progress lines for long work that read the same in a terminal and in a log file.

Progress bars (tqdm, Lightning's) redraw one line with carriage returns: in a log
file or a CI transcript they print nothing until the end, or a wall of partial
lines. Long phases (training steps, the closing evaluation, `python -m decode`)
report instead through `logging`, a whole line at a time: what is done out of
what, the rate, and the time left at that rate. Hydra's job logging sends the
lines to the terminal and to the run's log file alike.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


def format_duration(seconds: float) -> str:
    """A short human duration: '45 s', '3.2 min', '1.4 h'."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


class ProgressLog:
    """Logs '<what>: <done>/<total> <unit> (<detail>), <rate>, ~<time> left' at most every `every_seconds`.

    ``update(done)`` is called after each unit of work; a line is written when
    `every_seconds` have passed since the last one, when `done` is a multiple of
    `every_n` (if given), and always for the last unit. The rate and the time
    left are over everything done since the object was made.
    """

    def __init__(
        self,
        what: str,
        total: int,
        unit: str,
        logger: logging.Logger,
        every_seconds: float = 10.0,
        every_n: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if total < 1 or every_seconds <= 0 or (every_n is not None and every_n < 1):
            raise ValueError(f"progress needs total >= 1, every_seconds > 0, every_n >= 1: {total}, {every_seconds}")
        self.what, self.total, self.unit, self.logger = what, total, unit, logger
        self.every_seconds, self.every_n, self.clock = every_seconds, every_n, clock
        self.started = self.last_line = clock()
        self.lines = 0

    def update(self, done: float, detail: str = "") -> bool:
        """Record that `done` units are finished (a fraction counts the share of a unit's work done, shown rounded
        down); log a line if one is due. Returns whether it logged."""
        now = self.clock()
        due = (
            done >= self.total
            or now - self.last_line >= self.every_seconds
            or (self.every_n is not None and done == int(done) and done % self.every_n == 0)
        )
        if not due or done <= 0:
            return False
        elapsed = now - self.started
        per_unit = elapsed / done
        left = max(self.total - done, 0) * per_unit
        timing = f"{per_unit:.2f} s/{self.unit}" if per_unit < 60 else f"{format_duration(per_unit)}/{self.unit}"
        ending = f"done in {format_duration(elapsed)}" if done >= self.total else f"~{format_duration(left)} left"
        detail = f" ({detail})" if detail else ""
        self.logger.info("%s: %d/%d %ss%s, %s, %s", self.what, done, self.total, self.unit, detail, timing, ending)
        self.last_line, self.lines = now, self.lines + 1
        return True
