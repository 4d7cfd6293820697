"""Skews this process's wall clock by ``AWA_CLOCK_SKEW`` seconds (stress/hosts.py).

Put on ``PYTHONPATH`` of a worker process, it shifts ``time.time()``,
``time.time_ns()`` (and so log timestamps) and ``django.utils.timezone.now()``
as a host whose clock is off would. The monotonic clock is left alone, as a
real host's is. (Debian's libfaketime was tried first: under an offset it
made Python 3.12's ``time.sleep`` fail with EINVAL.)
"""

from __future__ import annotations

import datetime
import os
import time

_offset = float(os.environ.get("AWA_CLOCK_SKEW") or 0)
if _offset:
    _time, _time_ns = time.time, time.time_ns
    time.time = lambda: _time() + _offset
    time.time_ns = lambda: _time_ns() + int(_offset * 1e9)

    from django.utils import timezone

    _now = timezone.now

    def _skewed_now() -> datetime.datetime:
        return _now() + datetime.timedelta(seconds=_offset)

    timezone.now = _skewed_now
