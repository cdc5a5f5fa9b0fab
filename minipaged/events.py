"""Block events: each change to the pool, queued as it happens and handed to subscribers once the change is over.

An allocator emits a :class:`BlockEvent` for every change (allocate, free, fork, cow, and the
scheduler's preempt, swap_in, ...). Widgets and logs subscribe instead of polling; an engine's
metrics count the events of each step it runs. When an event reaches them:

* **A bare allocator** (chapter 02, no engine): when the public call that caused it returns. A
  table's growth by three blocks is three "allocate" events, heard once the table holds all three.
* **An engine step**: once the step is over. The engine holds its allocator's events for the whole
  step and hands them over when the step's state is final, as vLLM's ``BlockPool`` queues its KV
  events for the engine to take after the step. A step that fails is undone: its events are dropped
  and one ``"rollback"`` event is handed over instead.

So a subscriber always sees consistent state, and it may call anything: read, abort a request, even
step the engine again. A subscriber that raises cannot break the operation that emitted the event
(see :meth:`EventBus.subscribe`).
"""

from __future__ import annotations

import warnings
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field

from minipaged.validation import check_callable

SUBSCRIBER_ERRORS_KEPT = 16  # the latest subscriber errors an event bus keeps (all are counted)


@dataclass(frozen=True)
class BlockEvent:
    # "allocate", "free" (back in the pool), "incref", "decref", "fork", "cow", "preempt", ...
    kind: str
    block_id: int | None = None
    seq_id: object = None
    info: dict = field(default_factory=dict)


class EventBus:
    """Subscribers, and the events waiting for the end of the operation that caused them.

    Attributes:
        subscriber_errors: ``(event, callback, exception)`` of the latest :data:`SUBSCRIBER_ERRORS_KEPT`
            subscriber errors; :attr:`num_subscriber_errors` counts them all.
    """

    def __init__(self):
        self._subscribers: list = []
        self._held_events: list[BlockEvent] | None = None  # while an operation is in progress (see hold_events)
        self.subscriber_errors: deque[tuple[BlockEvent, object, Exception]] = deque(maxlen=SUBSCRIBER_ERRORS_KEPT)
        self.num_subscriber_errors = 0

    def subscribe(self, callback):
        """Call ``callback(event)`` on every event; returns a function that unsubscribes.

        Events arrive once the operation that caused them is over (see the module docstring), so the
        callback sees consistent state and may call anything.

        A callback that raises an ``Exception`` is isolated: the exception is recorded in
        :attr:`subscriber_errors` and reported with a ``RuntimeWarning``; the other callbacks still get
        the event. A ``BaseException`` that is not an ``Exception`` (``KeyboardInterrupt``,
        ``SystemExit``) is re-raised once every callback has had every event.

        Args:
            callback: a function of one :class:`BlockEvent`.
        """
        check_callable(callback, "callback", "callable (BlockEvent -> None)")
        self._subscribers.append(callback)

        def unsubscribe():
            if callback in self._subscribers:
                self._subscribers.remove(callback)

        return unsubscribe

    def emit(self, kind: str, block_id: int | None = None, seq_id=None, **info) -> None:
        """Publish an event, after the change it describes; it waits for the end of the operation in progress.

        Args:
            kind: what happened (``"allocate"``, ``"preempt"``, ...).
            block_id: the block it happened to (None: no single block).
            seq_id: the sequence it happened for (None: none).
            info: anything else a subscriber may want (``refcount=``, ``mode=``, ...).
        """
        event = BlockEvent(kind, block_id, seq_id, info)
        if self._held_events is not None:
            self._held_events.append(event)
        else:
            self._deliver([event])

    @contextmanager
    def hold_events(self):
        """Queue the events emitted inside the block; deliver them, in order, when the outermost block ends.

        An operation made of several changes (a table that grows by many blocks, a release, an engine
        step) runs inside one. Yields the queue, which the outermost block's owner may trim (an engine
        drops a failed step's events). The events are delivered even if the block raises.
        """
        if self._held_events is not None:  # nested: the outermost block delivers
            yield self._held_events
            return
        self._held_events = []
        try:
            yield self._held_events
        finally:
            events, self._held_events = self._held_events, None
            self._deliver(events)

    def _deliver(self, events: list[BlockEvent]) -> None:
        interrupt = None
        for event in events:
            for callback in list(self._subscribers):  # a callback may unsubscribe itself
                try:
                    callback(event)
                except Exception as exc:  # isolated: recorded and reported, never breaks the emitter
                    self.subscriber_errors.append((event, callback, exc))
                    self.num_subscriber_errors += 1
                    warnings.warn(f"event subscriber {callback!r} raised {exc!r} on a {event.kind!r} event; it was "
                                  "skipped (see subscriber_errors)", RuntimeWarning, stacklevel=2)  # fmt: skip
                except BaseException as exc:  # KeyboardInterrupt and the like: after every callback has every event
                    interrupt = interrupt or exc
        if interrupt is not None:
            raise interrupt
