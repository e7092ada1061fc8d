"""The chat tab's turns under way: which respond runs each, the Stops asked of it, and which finish keeps it."""

from __future__ import annotations

import collections
from typing import Any, Optional

from ..serving.streams import TextStream


class Turns:
    """The chat's turns (a message sent, and its reply) by the id in the page's pending state: the one respond
    that runs a turn (a second trigger of the same pending, Enter while a reply streams, finds it taken), its
    stream, the Stops asked of it, and the one finish that keeps it. A reply asked to stop ends itself, so that
    what its page showed is what is saved (one writer). Used on the event loop only."""

    KEPT = 1024  # turns remembered, the oldest over forgotten first (a running one never)

    def __init__(self) -> None:
        self._states: collections.OrderedDict[str, str] = collections.OrderedDict()  # "running", "ended", "settled"
        self._streams: dict[str, TextStream] = {}
        self._stops: dict[str, bool] = {}  # turn -> whether the message box was empty at the Stop

    def claim(self, turn: Optional[str]) -> bool:
        """Whether the caller runs this turn: the first to ask does, if no Stop settled it before."""
        if turn is None:
            return True
        if turn in self._states:
            return False
        self._states[turn] = "running"
        while len(self._states) > self.KEPT:
            oldest = next((t for t, state in self._states.items() if state != "running"), None)
            if oldest is None:
                break
            del self._states[oldest]
            self._stops.pop(oldest, None)
        return True

    def running(self, turn: Optional[str], stream: TextStream) -> None:
        if turn is not None:
            self._streams[turn] = stream
            if turn in self._stops:  # stopped while it was being submitted
                stream.cancel()

    def end(self, turn: Optional[str]) -> None:
        self._streams.pop(turn, None)
        if self._states.get(turn) == "running":
            self._states[turn] = "ended"

    def stop(self, turn: Any, box_empty: bool) -> bool:
        """Asks the turn to end; True where it had not begun: it is over now (no respond will run it, no
        finish keep it), and the caller puts the page back."""
        if type(turn) is not str:
            return False
        if turn not in self._states:
            self._states[turn] = "settled"
            return True
        if self._states[turn] == "running":
            self._stops[turn] = box_empty
            stream = self._streams.get(turn)
            if stream is not None:  # ends it in the engine now, whether or not text is coming
                stream.cancel()
        return False

    def stopped(self, turn: Optional[str]) -> bool:
        return turn in self._stops

    def box_empty_at_stop(self, turn: Optional[str]) -> bool:
        return self._stops.get(turn, True)

    def settle(self, turn: Optional[str]) -> bool:
        """Whether the caller (a finish) keeps the turn: once, after its respond ended."""
        if turn is None or self._states.get(turn, "ended") != "ended":
            return turn is None
        self._states[turn] = "settled"
        self._stops.pop(turn, None)
        return True

