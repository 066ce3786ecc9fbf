"""SIGTERM and SIGINT as exceptions that always land: a command's work stops within seconds whatever it is doing,
and its `finally` blocks remove what it half wrote.

Python runs a signal's handler between two bytecodes of the main thread, and the exception it raises can be
swallowed: `ct.convert` ends in `gc.collect()`, where coremltools' palettizer objects run their `__del__`, and an
exception raised in a `__del__` is dropped ("Exception ignored", and coremltools' output is hidden at that point):
a SIGTERM landing there let `build --compress palettize4` run to its end. Import guards under a bare `except:`
(coremltools' optional dependencies) drop it the same way. So
while a signal is pending, a watchdog thread looks at the main thread every POLL_S: when the main thread is not
unwinding that signal's exception (the exception is neither raised nor being handled there: it was swallowed),
the signal is delivered again (`_thread.interrupt_main`), until the command ends. `held()` keeps the exception out
of a block that must finish once started (a rename that puts a set of outputs in place, the removal of temps): a
signal that arrives inside is raised when the block ends."""
from __future__ import annotations

import _thread
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

POLL_S = 0.5  # how often the watchdog checks that a pending signal's exception is on its way


class Terminated(BaseException):
    """SIGTERM as an exception, so `finally` blocks remove temp files as they do on Ctrl-C."""


_EXCEPTIONS = {signal.SIGTERM: Terminated, signal.SIGINT: KeyboardInterrupt}


class _State:
    def __init__(self) -> None:
        self.pending: int | None = None  # the signal received and not yet ended the command
        self.holding = 0  # depth of `held()` blocks the main thread is in
        self.done = threading.Event()  # the command ended: the watchdog stops


_state: _State | None = None


def _handler(signum: int, frame: object) -> None:
    state = _state
    if state is None or state.done.is_set():
        return  # a delivery again that came as the command ended
    first = state.pending is None
    state.pending = signum
    if first:
        threading.Thread(target=_watch, args=(state, threading.main_thread().ident), daemon=True,
                         name="npumoe-signal-watchdog").start()
    if state.holding or _unwinding(sys.exc_info()[1]):
        return  # raised when the held block ends; or already on its way out: let the cleanup run whole
    raise _EXCEPTIONS[signum]


def _unwinding(exc: BaseException | None) -> bool:
    """Whether `exc` (the exception the main thread is handling: an `except` or a `finally` on its way) is, or was
    caused while handling, a signal's exception."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, tuple(_EXCEPTIONS.values())):
            return True
        seen.add(id(exc))
        exc = exc.__context__
    return False


def _handled(thread: int) -> BaseException | None:
    """The exception `thread` is handling (Python 3.11 gives it as an exc_info tuple, 3.12 on as itself)."""
    exc = sys._current_exceptions().get(thread)
    return exc[1] if isinstance(exc, tuple) else exc


def _watch(state: _State, main: int) -> None:
    while not state.done.wait(POLL_S):
        if state.holding or _unwinding(_handled(main)):
            continue
        _thread.interrupt_main(state.pending)  # swallowed on the way: raise it again where the main thread is now


@contextmanager
def signals_raise() -> Iterator[None]:
    """Within the block, SIGTERM raises Terminated and SIGINT KeyboardInterrupt in the main thread, and keep being
    raised until one ends the block (module docstring). Outside the main thread (signals reach only that one) the
    block runs as it is."""
    global _state
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    outer, _state = _state, _State()
    previous = {s: signal.signal(s, _handler) for s in _EXCEPTIONS}
    try:
        yield
    finally:
        _state.done.set()
        for s, h in previous.items():
            signal.signal(s, h)
        _state = outer


@contextmanager
def held() -> Iterator[None]:
    """Run the block whole: a SIGTERM or SIGINT that arrives inside it is raised when it ends (nothing changes
    outside `signals_raise` or off the main thread)."""
    state = _state
    if state is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    state.holding += 1
    try:
        yield
    finally:
        state.holding -= 1
    if not state.holding and state.pending is not None and not _unwinding(sys.exc_info()[1]):
        raise _EXCEPTIONS[state.pending]
