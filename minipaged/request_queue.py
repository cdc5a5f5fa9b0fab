"""Scheduling policies: the waiting queue's order, and which running sequence a policy preempts.

A policy is a waiting-queue class (as vLLM V1's ``create_request_queue`` picks one per policy).
The scheduler only ever

- ``append(seq)``: a new request arrives (the policy decides where it queues);
- ``appendleft(seq)``: a preempted sequence goes back to the front (it has waited longest);
- reads ``queue[0]`` and ``popleft()``s it when it is admitted, and ``remove(seq)``s an abort;
- asks ``victim(running)`` for the running sequence to preempt when the pool runs out.

The queues are deques, so iterating, ``len`` and indexing work as on the deque they were; the
dashboard reads ``scheduler.waiting`` that way. A new policy is one class here (or in your own
file) plus one :func:`register_policy` call.
"""

from __future__ import annotations

from collections import deque

from minipaged.sequence import Sequence, SequenceStatus


class FCFSQueue(deque):
    """First come, first served: arrivals queue at the back; the youngest running sequence is preempted."""

    @staticmethod
    def victim(running: list[Sequence]) -> Sequence:
        """The youngest running sequence (latest arrival; on a tie the later admitted), so older ones progress.

        Args:
            running: the running sequences, in admission order (not modified).
        """
        ### BEGIN SOLUTION (Exercise 05, Task 5.1)
        return max(reversed(running), key=lambda s: s.arrival_time)
        ### END SOLUTION


class ShortestPromptFirstQueue(FCFSQueue):
    """Preempted sequences first (in their order), then waiting ones by prompt length, ties in arrival order.

    Chapter 07's admission-order ablation. An arrival is inserted at its place, so the queue is
    always in order and admission reads its head, as with FCFS.
    """

    def append(self, seq: Sequence) -> None:
        """Queue ``seq`` after every preempted sequence and every waiting one with a prompt no longer than its own."""
        for i, other in enumerate(self):
            if other.status is not SequenceStatus.PREEMPTED and other.num_prompt_tokens > seq.num_prompt_tokens:
                self.insert(i, seq)
                return
        super().append(seq)


SCHEDULING_POLICIES: dict[str, type] = {"fcfs": FCFSQueue, "shortest_prompt_first": ShortestPromptFirstQueue}


def register_policy(name: str, queue_class: type) -> None:
    """Make ``EngineConfig(scheduling_policy=name)`` use ``queue_class`` (refuses a name already taken).

    Args:
        name: the policy's name.
        queue_class: a :class:`collections.deque` subclass with a ``victim(running)`` method (see the
            module docstring for what the scheduler calls).
    """
    check_policy_registration(name, queue_class, SCHEDULING_POLICIES)
    SCHEDULING_POLICIES[name] = queue_class


def create_request_queue(policy: str) -> deque:
    """An empty waiting queue for ``policy`` (one of :data:`SCHEDULING_POLICIES`)."""
    return SCHEDULING_POLICIES[policy]()


def check_policy_registration(name, queue_class, registry: dict) -> None:
    """The arguments of ``request_queue.register_policy``, checked before the registry changes.

    Args:
        name: a str not in ``registry``.
        queue_class: a :class:`collections.deque` subclass with a ``victim(running)`` method.
        registry: the policies registered now, name -> queue class.

    Raises:
        TypeError: ``name`` is not a str, or ``queue_class`` is not such a class.
        ValueError: ``name`` is already registered.
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    if name in registry:
        raise ValueError(f"scheduling policy {name!r} is already registered")
    victim = getattr(queue_class, "victim", None)
    if not (isinstance(queue_class, type) and issubclass(queue_class, deque) and callable(victim)):
        raise TypeError(f"queue_class must be a deque subclass with a victim(running) method, got {queue_class!r:.60}")
