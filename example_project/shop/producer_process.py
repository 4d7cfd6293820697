"""The producers' process of ``manage.py awa_demo`` (``demo.ProducerProcess``).

A module of its own, importing nothing from Django at the top: a ``spawn``
child unpickles its target by importing the target's module, before
``django.setup()`` could run, and ``demo`` imports models.
"""

from __future__ import annotations

import multiprocessing
import signal
import sys
from typing import Any


def produce(
    rate: float,
    alias: str,
    count: int,
    burst: tuple[int, float] | None,
    order_share: float,
    counts: Any,
    ready: Any,
    go: Any,
    stop: Any,
) -> None:
    """The body of ``demo.ProducerProcess``: ``Producers`` in a process of their own.

    Started with ``spawn``: a fresh interpreter that sets Django up from the
    environment the demo's process was given, not a fork of a process whose
    threads hold connections. It sets ``ready`` once Django is set up (under
    load, starting an interpreter and Django takes seconds) and produces from
    ``go`` until ``stop``. Its counts (orders, other jobs, of
    them in bursts) go back through ``counts``, a shared array, ten times a
    second and once more at the end.
    """
    import django

    # A Ctrl-C in the terminal reaches this process too: the demo's process
    # decides what it means (drain, or stop now) and tells this one by ``stop``.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    django.setup()
    from .demo import Producers, quiet_logging  # models: only once Django is set up

    # The demo's process, watched: killed (no stop), it must not leave this one
    # producing orders for ever.
    parent = multiprocessing.parent_process()

    def orphaned() -> bool:
        return parent is not None and not parent.is_alive()

    producers = Producers(
        rate, alias, sys.stderr, count=count, burst=burst, order_share=order_share
    )
    ready.set()
    while not go.wait(0.1):
        if stop.is_set() or orphaned():
            return
    with quiet_logging():
        producers.start()
        try:
            while not stop.wait(0.1) and not orphaned():
                counts[:] = [producers.orders, producers.others, producers.bursts]
        finally:
            producers.stop()
            producers.join(10)
            counts[:] = [producers.orders, producers.others, producers.bursts]
