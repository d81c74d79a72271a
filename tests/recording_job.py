"""A ``Job`` that keeps every progress report, for tests of chunked runs."""

from __future__ import annotations

from dxserve.core.progress import Job


class Recording(Job):
    """A job that keeps every report (``seen``) and cancels itself once ``stop_at``
    items are done, when given."""

    def __init__(self, stop_at: int | None = None) -> None:
        super().__init__()
        self.seen: list[int] = []
        self.stop_at = stop_at

    def report(self, done: int) -> None:
        self.seen.append(done)
        super().report(done)
        if self.stop_at is not None and done >= self.stop_at:
            self.cancel()
