"""Ctrl-C is never swallowed by a finalizer, for library users as for the command line.

Python runs a signal handler wherever the main thread is, finalizers included. A
KeyboardInterrupt raised inside a `__del__` or a weakref callback cannot propagate: it is
printed as "Exception ignored in: ..." and dropped, and the program goes on as if the
user had not pressed Ctrl-C. A guarded step runs many finalizers (every saved tensor's
`Packed` in runtime/hooks.py is released by one as backward consumes it), so without
this the interrupt was lost in 2 of 4 trials.

`sys.unraisablehook` sees every such drop. `redeliver(exc)` raises `exc` again at the
first Python call or return outside every finalizer (a profile function's exception
propagates into the code it profiles: CPython 3.11, `sys.setprofile`). Re-arming the
signal instead (`_thread.interrupt_main`) would run the handler again at once, still
inside the finalizer.

    with interrupts_not_swallowed():   # what every guarded step runs inside
        ...
"""

from __future__ import annotations

import contextlib
import sys
import threading
from types import FrameType
from typing import Optional

_FINALIZER_FRAMES = ("__del__", "_unraisable", "_swallowed")


def in_finalizer(frame: Optional[FrameType]) -> bool:
    """Whether a `__del__` or an unraisable hook of this project is on the stack (a
    weakref callback elsewhere is caught by the hook instead)."""
    depth = 0
    while frame is not None and depth < 64:
        if frame.f_code.co_name in _FINALIZER_FRAMES:
            return True
        frame, depth = frame.f_back, depth + 1
    return False


def redeliver(exc: BaseException) -> None:
    """Raise `exc` at the first call or return outside every finalizer of this thread;
    whatever profile function was set is put back first."""
    previous = sys.getprofile()

    def deliver(frame, event, arg):
        if not in_finalizer(frame):
            sys.setprofile(previous)
            raise exc

    sys.setprofile(deliver)


@contextlib.contextmanager
def interrupts_not_swallowed():
    """While inside: a KeyboardInterrupt dropped by a finalizer is raised again just
    after it. Other unraisable exceptions go to the hook that was there. Outside the main
    thread (no signal is delivered there) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = sys.unraisablehook

    def _swallowed(unraisable) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            redeliver(unraisable.exc_value)
            return
        previous(unraisable)

    sys.unraisablehook = _swallowed
    try:
        yield
    finally:
        if sys.unraisablehook is _swallowed:
            sys.unraisablehook = previous
