"""The page's login check: one wrong guess a second for everyone together, a right login at once otherwise."""

from __future__ import annotations

import asyncio
import inspect
import time

import pytest
from fastapi import HTTPException

from llama_core.app.logins import LoginCheck


def test_the_check_is_an_async_function_as_gradio_awaits_it():
    # Gradio awaits auth only where inspect says it is a coroutine function; called plainly, the coroutine it
    # returned would be taken as True: anyone let in.
    assert inspect.iscoroutinefunction(LoginCheck([("ann", "pw")]).check)


def test_right_and_wrong_logins():
    check = LoginCheck([("ann", "s3cret"), ("bo", "x")], failed_seconds=0.0).check

    async def tries():
        return [await check(*login) for login in (("ann", "s3cret"), ("bo", "x"), ("ann", "x"), ("cy", "s3cret"),
                                                   ("ann", "s3cret "), ("ann", ""))]

    assert asyncio.run(tries()) == [True, True, False, False, False, False]


def test_wrong_guesses_take_turns_a_while_apart_and_too_many_at_once_are_refused():
    logins = LoginCheck([("ann", "s3cret")], failed_seconds=0.2, max_waiting=4)

    async def guesses():
        started = time.monotonic()
        answers = await asyncio.gather(*(logins.check("ann", f"guess{i}") for i in range(4)), return_exceptions=True)
        took = time.monotonic() - started
        crowd = await asyncio.gather(*(logins.check("ann", f"more{i}") for i in range(6)), return_exceptions=True)
        return answers, took, crowd

    answers, took, crowd = asyncio.run(guesses())
    assert answers == [False] * 4 and took >= 3 * 0.2  # each after the one before failed, 0.2 s later
    refused = [a for a in crowd if isinstance(a, HTTPException)]
    assert len(refused) == 2 and all(r.status_code == 429 and "Too many login attempts" in r.detail for r in refused)


def test_a_right_login_with_no_recent_failure_is_not_held():
    logins = LoginCheck([("ann", "s3cret")], failed_seconds=30.0)

    async def login():
        return await asyncio.wait_for(logins.check("ann", "s3cret"), timeout=5)

    assert asyncio.run(login()) is True
    with pytest.raises(asyncio.TimeoutError):  # after a failure, the next try waits its 30 s
        async def after_failure():
            await logins.check("ann", "wrong")
            return await asyncio.wait_for(logins.check("ann", "s3cret"), timeout=0.5)
        asyncio.run(after_failure())


def test_guesses_at_one_users_password_do_not_hold_another_users_login():
    logins = LoginCheck([("ann", "s3cret"), ("bo", "pw")], failed_seconds=30.0)

    async def tries():
        await logins.check("ann", "wrong")  # ann's next try waits 30 s; bo's and a stranger's do not wait on it
        bo = await asyncio.wait_for(logins.check("bo", "pw"), timeout=5)
        stranger = await asyncio.wait_for(logins.check("cy", "pw"), timeout=5)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(logins.check("ann", "s3cret"), timeout=0.5)
        with pytest.raises(asyncio.TimeoutError):  # names that are no user's take turns together
            await asyncio.wait_for(logins.check("dee", "pw"), timeout=0.5)
        return bo, stranger

    assert asyncio.run(tries()) == (True, False)
