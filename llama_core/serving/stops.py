"""Stop strings over streamed text: where a reply ends, and how much text must wait before it is shown."""

from __future__ import annotations

from typing import Sequence


class StopMatcher:
    """Feeds a reply's text as it streams; returns what can be shown. Holds back only a tail that could still
    begin a stop string; once a stop string is complete, `stopped` is set and the text from it on is dropped."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.stopped = False
        self._held = ""

    def feed(self, text: str) -> str:
        """The text that is now safe to show, given the next piece."""
        if self.stopped or not self.stops:
            return "" if self.stopped else text
        buffer = self._held + text
        found = [i for i in (buffer.find(s) for s in self.stops) if i >= 0]
        if found:
            self.stopped, self._held = True, ""
            return buffer[: min(found)]
        hold = max((k for s in self.stops for k in range(min(len(s) - 1, len(buffer)), 0, -1)
                    if buffer.endswith(s[:k])), default=0)
        self._held = buffer[len(buffer) - hold :]
        return buffer[: len(buffer) - hold]

    def flush(self) -> str:
        """The held-back text at the end of a reply that did not stop."""
        held, self._held = self._held, ""
        return "" if self.stopped else held


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """text up to the first occurrence of any stop string."""
    ends = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return text[: min(ends)] if ends else text
