"""One progress convention for every long-running library function.

Every function that can run for minutes (:func:`rotationzoo.evaluate.evaluate`,
:func:`rotationzoo.fit.fit_rotations`, :func:`rotationzoo.fit.refine_fit`,
:func:`rotationzoo.integrations.transformers.calibrate`, ...) takes ``progress``, a callable::

    progress(done, total, what)

``done`` of ``total`` units of the current *stage* are finished; ``what`` says in a few words what
is running now (``"layer 3"``, ``"hadamard draw 2"``, ``"capture"``). Within a stage ``total``
stays the same and ``done`` only grows, from ``0`` (the stage starts; the total is known before
its first unit, so an ETA can start at once) to ``total``; a new stage (a different total, or
``done`` going back) starts over. Work on a thread pool calls ``progress`` from its worker threads.

The command line renders it (a bar on a terminal, a few plain lines otherwise:
``rotationzoo.cli._output.progress_reporter``); scripts can pass any callable, e.g.
``lambda done, total, what: print(done, total, what)``.
"""

from __future__ import annotations

import threading
from typing import Callable, Hashable

#: ``progress(done, total, what)``: see the module docstring.
Progress = Callable[[int, int, str], None]


def prefixed(progress: Progress | None, prefix: str) -> Progress | None:
    """``progress`` with ``what`` read as ``"<prefix>: <what>"`` (``None`` stays ``None``)."""
    if progress is None:
        return None
    sink = progress

    def report(done: int, total: int, what: str) -> None:
        sink(done, total, f"{prefix}: {what}" if what else prefix)

    return report


class Tally:
    """Several counters (e.g. layers on a thread pool, each counting its own units) reported as
    one stage of ``progress``: the sum of the counters against the sum of their totals.

    Args:
        progress: where to report (``None``: nothing is reported).
        total: units of the whole stage.
        what: the stage's label until a counter names itself.

    Thread-safe: counters may be set from several threads.
    """

    def __init__(self, progress: Progress | None, total: int, what: str = "") -> None:
        self.progress = progress
        self.total = max(0, int(total))
        self.what = what
        self._counts: dict[Hashable, int] = {}
        self._done = 0
        self._lock = threading.Lock()

    def start(self) -> None:
        """Report ``0 / total`` (the stage starts)."""
        if self.progress is not None:
            with self._lock:
                self.progress(self._done, self.total, self.what)

    def set(self, key: Hashable, done: int, what: str | None = None) -> None:
        """Counter ``key`` has finished ``done`` of its units."""
        if self.progress is None:
            return
        with self._lock:
            self._done += int(done) - self._counts.get(key, 0)
            self._counts[key] = int(done)
            self.progress(min(self._done, self.total), self.total, self.what if what is None else what)
