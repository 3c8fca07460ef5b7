"""A call that may block opening a FIFO, run so that a hang fails the test instead of the
suite: the call runs in a thread; if it is still blocked after ``seconds`` the FIFO is opened
for writing (the blocked reader returns, the thread ends) and the test fails."""

from __future__ import annotations

import os
import threading

import pytest


def raised_without_blocking(fn, fifo, seconds: float = 10.0) -> BaseException | None:
    """``fn()``'s exception (None if it returned), or the test fails if it blocked."""
    box = {}

    def call():
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["exc"] = exc

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(5)
        pytest.fail(f"opening the FIFO {fifo} blocked for {seconds} s")
    return box.get("exc")
