"""The page's login check, slowed for guessing: Gradio's own answers every try at once (100 wrong logins took
1.6 s), so a password of a shared link could be guessed at thousands a second. Here tries are checked one at a
time, and a try after a failed one waits until FAILED_LOGIN_SECONDS have passed since it: at most one wrong
guess a second, for everyone together (a share link's users all come from one address). With no failure in
the last second, a login is checked at once."""

from __future__ import annotations

import asyncio
import hmac
import math
import time
from typing import Optional, Sequence

from fastapi import HTTPException

FAILED_LOGIN_SECONDS = 1.0
MAX_WAITING_LOGINS = 16  # tries waiting their turn; more at once are answered 429


class LoginCheck:
    """Checks (user, password) logins for Gradio (`check`, an async function as Gradio's `auth` takes it)."""

    def __init__(self, logins: Sequence[tuple[str, str]], failed_seconds: float = FAILED_LOGIN_SECONDS,
                 max_waiting: int = MAX_WAITING_LOGINS) -> None:
        self.passwords = dict(logins)
        self.failed_seconds = failed_seconds
        self.max_waiting = max_waiting
        self._turn: Optional[asyncio.Lock] = None  # made on the web server's event loop, as the first try comes
        self._waiting = 0
        self._failed_at = -math.inf

    async def check(self, username: str, password: str) -> bool:
        """Whether the login is one of those given; raises HTTPException 429 while too many tries wait."""
        if self._waiting >= self.max_waiting:
            raise HTTPException(status_code=429, detail="Too many login attempts at once; try again in a few seconds.")
        if self._turn is None:
            self._turn = asyncio.Lock()
        self._waiting += 1
        try:
            async with self._turn:
                wait = self._failed_at + self.failed_seconds - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                known = self.passwords.get(username)
                right = known is not None and hmac.compare_digest(password.encode(), known.encode())
                if not right:
                    self._failed_at = time.monotonic()
                return right
        finally:
            self._waiting -= 1
