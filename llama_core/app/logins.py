"""The page's login check, slowed for guessing: Gradio's own answers every try at once (100 wrong logins took
1.6 s), so a password of a shared link could be guessed at thousands a second. Here the tries for one user
name are checked one at a time, and a try after a failed one waits until FAILED_LOGIN_SECONDS have passed
since it: at most one wrong guess a second at each user's password, from everyone together (a share link's
users all come from one address); names that are no user's take turns together. With no failure in the last
second, a login is checked at once; another user's is not held by guesses at one user's password."""

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
        self._turns: dict[Optional[str], _Turns] = {}  # by user name (None: no user's), made as tries come

    async def check(self, username: str, password: str) -> bool:
        """Whether the login is one of those given; raises HTTPException 429 while too many tries wait."""
        known = self.passwords.get(username)
        key = username if known is not None else None
        turns = self._turns.get(key) or self._turns.setdefault(key, _Turns())
        if turns.waiting >= self.max_waiting:
            raise HTTPException(status_code=429, detail="Too many login attempts at once; try again in a few seconds.")
        turns.waiting += 1
        try:
            async with turns.lock:
                wait = turns.failed_at + self.failed_seconds - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                right = known is not None and hmac.compare_digest(password.encode(), known.encode())
                if not right:
                    turns.failed_at = time.monotonic()
                return right
        finally:
            turns.waiting -= 1


class _Turns:
    """The tries at one user's password (or at names that are no user's): one at a time."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()  # made on the web server's event loop, as the first try comes
        self.waiting = 0
        self.failed_at = -math.inf
