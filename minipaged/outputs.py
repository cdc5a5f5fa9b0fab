"""What the engine hands back: per step a :class:`StepOutput`, per finished request a :class:`RequestOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field

from minipaged.sequence import Sequence


@dataclass
class RequestOutput:
    """A request that finished, as :meth:`Engine.step` hands it over: its id and its samples, in order."""

    request_id: object
    seqs: list[Sequence]

    @property
    def output_token_ids(self) -> list[list[int]]:
        """Each sample's generated tokens (a stop token that ended it included)."""
        return [s.output_token_ids for s in self.seqs]

    @property
    def finish_reason(self) -> list[str]:
        """Each sample's ``finish_reason``: ``"stop"``, ``"length"``, or ``"abort"`` for one aborted alone."""
        return [s.finish_reason for s in self.seqs]

    @property
    def stop_reason(self) -> list[int | None]:
        """Each sample's ``stop_reason``: the stop token that ended it, None for the EOS or a length."""
        return [s.stop_reason for s in self.seqs]


@dataclass
class StepOutput:
    """What one step did, by seq_id; ``outputs``: the requests it finished."""

    step: int
    time: float
    scheduled: dict = field(default_factory=dict)  # seq_id -> tokens computed this step
    sampled: dict = field(default_factory=dict)  # seq_id -> the token sampled this step
    drafts: dict = field(default_factory=dict)  # seq_id -> draft tokens it verified (speculative decoding)
    accepted: dict = field(default_factory=dict)  # seq_id -> the drafts it accepted, before its sampled token
    admitted: list = field(default_factory=list)
    preempted: list = field(default_factory=list)
    finished: list = field(default_factory=list)
    outputs: list[RequestOutput] = field(default_factory=list)
