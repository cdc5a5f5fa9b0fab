"""Prefill/decode disaggregation: one engine computes prompts, another generates, and K/V moves between them.

**Why.** In one engine (chapter 05) every step mixes the two phases: decode tokens of the
running requests and chunks of new prompts share a forward pass. A prompt chunk makes that
step longer, so every running request's next token waits for it: TPOT rises whenever prompts
arrive, and TTFT rises whenever many requests are decoding. Chunked prefill bounds the damage;
disaggregation removes it. A *prefill engine* only computes prompts (and samples each request's
first token); a *decode engine*, with its own block pool, only generates. Each can then be sized
and tuned for its own latency target. As vLLM's documentation says of its disaggregated
prefilling: it tunes TTFT and TPOT separately and controls the tail of TPOT, and it does NOT
improve throughput (the same work still has to be done, now on two machines that each idle
while the other is the bottleneck). :func:`compare_disaggregation` measures both claims.

**How** (:class:`DisaggregatedEngine`):

1. A request arrives at the prefill engine (asked for at most 2 tokens, so its pool needs room
   for the prompt only; it never computes the second one).
2. When a prefill step samples the request's first token (streamed to the user from there: its
   TTFT ends here), the request leaves the prefill engine with its blocks
   (:func:`take_prefilled`) and waits for the decode engine.
3. When the decode engine has a free seat and room (its own FCFS rule, after the requests it
   preempted itself), the **KV transfer** starts (:func:`transfer_kv`): blocks are allocated in
   the decode pool (after the ones its prefix cache already holds, which are shared), every
   layer's K and V of the request's other blocks are copied into them, and the request gets a new
   block table over them. Its source blocks stay held until the transfer ends.
4. The transfer takes ``bytes / bandwidth`` over one link (:class:`KVLink`, one transfer at a
   time). When it ends, the source blocks are freed in the prefill pool and the request joins the
   decode engine's running batch (:func:`add_prefilled`):
   the decode engine cannot start it earlier. Its next step computes the first token's K/V and
   samples the second token; the time from the first token to the last, transfer included, is its TPOT.

**Time.** Each engine has its own :class:`~minipaged.clock.VirtualClock`: two GPUs working at
the same time, each step costing what the cost model says. :meth:`DisaggregatedEngine.step`
processes the earliest next event of the two (an arrival, a transfer's start or end, a prefill
step, a decode step), so the clocks never see an event from the other's future. On the wall
clock this would decouple nothing: both engines run in one Python process on the same 2 CPU
cores, so a prefill step and a decode step can never overlap, and a decode step waits for the
prefill step before it exactly as in one mixed engine. Only modelled time lets two engines run
side by side. (:class:`~minipaged.clock.WallClock` is refused for that reason.)

**What is copied.** The transfer copies the tiny model's real K/V (tokens come out equal to one
engine's, token for token). The link is charged the *modelled* model's bytes, like the virtual
clock, which prices steps for a 7B model: ``KVLink.bytes_per_token`` defaults to Llama-2-7B's
512 KiB (see :func:`~minipaged.accounting.kv_bytes_per_token`), whole blocks are moved, and the
default bandwidth, 25 GB/s, is a 200 Gb/s RDMA link.

**Prefix caching.** Each pool shares only its own blocks, and caching stays on in both. On the
prefill side the request's full prompt blocks get their keys as usual, and when its transfer ends
they are freed *cached*, so a later request with the same prefix skips that part of its prefill.
On the decode side, before a transfer starts, the request's tokens are looked up in the decode
pool's own cache (as at admission): the blocks found there are shared, and only the rest are
allocated, copied and charged on the link (vLLM's KV connectors likewise load only what the decode
side's prefix cache lacks). A block the prefill pool shared between requests is moved once per
request unless the decode pool has it cached: a transfer moves K/V, not references. Parallel
sampling (``n > 1``) is refused: its samples would each need their own copy.

**What the numbers say** (:func:`compare_disaggregation`, ``python -m minipaged.bench disagg``). At
equal total memory, against one mixed engine, the decode engine's steps carry no prompt, so TPOT
stops rising with the load (its tail falls about 2x at 18 requests/s), while TTFT barely moves:
one engine still computes every prompt. Throughput is the same: below saturation the arrivals
set it, and at saturation the fair baseline is two mixed engines (the same memory and the same
two GPUs), which serve slightly *more* tokens per second and give shorter TTFTs, since both of
them prefill. What disaggregation buys is a TPOT that prompts cannot disturb, and two engines
that can be sized and tuned apart (``prefill_max_num_batched_tokens``: a big prefill budget
shortens TTFT without touching TPOT, which one mixed engine cannot do).

A suggested notebook section (chapter 08), on the tiny random model (about 3 s of CPU per comparison)::

    import torch; torch.set_num_threads(1)
    from minipaged.disagg import DISAGG_PRESET, DisaggregatedEngine, KVLink, compare_disaggregation, transfer_kv
    from minipaged.latency import format_summary
    from minipaged.workload import make_workload
    cmp = compare_disaggregation(tiny, make_workload(24, rate=18, preset=DISAGG_PRESET, seed=0))
    print(format_summary(cmp.summaries, unit="ms"))  # mixed, 2 x mixed, disaggregated
    print(cmp.describe())                            # busy shares, transfers, and the ratios the prose quotes
    sat = compare_disaggregation(tiny, make_workload(24, rate=math.inf, preset=DISAGG_PRESET, seed=0))
    print(sat.describe())                            # saturated: the throughput ratios (x1.1 vs one, <1 vs two)
    # a figure: CDFs of cmp.latencies[name]["tpot"] (and "ttft") per setup, or the step durations of
    # cmp.engines["mixed"][0].metrics.history against cmp.engines["disaggregated"][1].metrics.history
    # a demo on the course model: d = DisaggregatedEngine(course, EngineConfig(...), EngineConfig(...));
    # d.generate(prompts) == Engine(course).generate(prompts); show_source(transfer_kv); a loop of d.step()
    # printing out.kind, out.time, out.request_ids: arrive, prefill, transfer_start, transfer_end, decode, ...
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

from minipaged.accounting import kv_bytes_per_token
from minipaged.block_math import blocks_needed
from minipaged.blocks import BlockTable, OutOfBlocks
from minipaged.cache import PagedKVCache
from minipaged.clock import StepCost, VirtualClock
from minipaged.engine import Engine, RequestOutput, StepOutput
from minipaged.latency import request_latencies, summarize
from minipaged.prefix_cache import PrefixCachingAllocator
from minipaged.replay import add_all, check_workload, workload_request
from minipaged.scheduler import EngineConfig, check_fits_pool
from minipaged.sequence import SamplingParams, Sequence, SequenceStatus
from minipaged.swap import swap_in, swap_out
from minipaged.validation import check_hashable, check_int, check_real
from minipaged.workload import LogNormal, RequestSpec, WorkloadPreset, prompt_token_ids

LLAMA_2_7B_KV_BYTES_PER_TOKEN = kv_bytes_per_token("Llama-2-7B")  # 2 * 32 layers * 32 heads * 128 * 2 B = 512 KiB

# Prompts long next to the answers: the workload where prefill gets in the way of decode.
DISAGG_PRESET = WorkloadPreset("tiny_long_prompts", LogNormal(256, 0.4, 64, 768), LogNormal(12, 0.5, 4, 32))


@dataclass(frozen=True)
class KVLink:
    """The link between the prefill and the decode engine; one transfer at a time, in order.

    Args:
        bandwidth: bytes per second (default 25 GB/s, a 200 Gb/s RDMA link).
        bytes_per_token: K/V bytes one token costs on the link (default: Llama-2-7B's, the model
            the virtual clock prices); None charges the pools' real bytes (the tiny model's).
    """

    bandwidth: float = 25e9
    bytes_per_token: int | None = LLAMA_2_7B_KV_BYTES_PER_TOKEN

    def __post_init__(self):
        bandwidth = check_real(self.bandwidth, "KVLink.bandwidth", minimum=0)
        if bandwidth == 0:
            raise ValueError("KVLink.bandwidth must be > 0 bytes per second, got 0")
        object.__setattr__(self, "bandwidth", bandwidth)
        if self.bytes_per_token is not None:
            object.__setattr__(self, "bytes_per_token", check_int(self.bytes_per_token, "KVLink.bytes_per_token",
                                                                  minimum=1))  # fmt: skip

    def num_bytes(self, num_blocks: int, cache: PagedKVCache) -> int:
        """Bytes charged for moving ``num_blocks`` whole blocks of ``cache``."""
        if self.bytes_per_token is None:
            return num_blocks * cache.bytes_per_block
        return num_blocks * cache.block_size * self.bytes_per_token

    def seconds(self, num_bytes: int) -> float:
        """How long ``num_bytes`` take on this link."""
        return num_bytes / self.bandwidth


@dataclass
class KVTransfer:
    """One request's K/V moving from the prefill pool to the decode pool (times in the shared virtual time).

    Attributes:
        request_id: the request.
        num_tokens: computed tokens it needs in the decode pool (its prompt).
        num_blocks: blocks moved (whole blocks: ``ceil(num_tokens / block_size)``, less the hit blocks).
        num_bytes: bytes charged on the link (see :class:`KVLink`).
        ready_time: its first token was sampled; it waits for the decode engine from here.
        start_time: the decode engine gave it blocks and the link was free.
        end_time: its K/V has arrived; it joins the decode engine's batch and the source blocks are freed.
        num_hit_blocks: its first blocks, found in the decode pool's own prefix cache: shared, not moved.
    """

    request_id: object
    num_tokens: int
    num_blocks: int
    num_bytes: int
    ready_time: float
    start_time: float
    end_time: float
    num_hit_blocks: int = 0
    seq: Sequence | None = field(default=None, repr=False)  # while in flight
    src_table: BlockTable | None = field(default=None, repr=False)
    dst_table: BlockTable | None = field(default=None, repr=False)

    @property
    def wait(self) -> float:
        """Seconds between the first token and the transfer's start (the decode engine had no room)."""
        return self.start_time - self.ready_time


def take_prefilled(engine: Engine, request_id) -> Sequence:
    """Take a request whose prompt is computed and whose first token is sampled out of ``engine``.

    The engine forgets it (it is no longer running there); its block table still holds its
    blocks in that engine's pool, so their K/V stays put until the caller, who now owns the
    table, has copied it elsewhere and calls ``seq.block_table.release()``. Between steps only;
    all checks come first, so an error changes nothing.

    Args:
        engine: the prefill engine.
        request_id: a running request of one sample whose next token to compute is its first output.

    Raises:
        TypeError: ``request_id`` is not hashable.
        KeyError: no such request.
        ValueError: it has several samples, or is not in that state (waiting, mid-prefill, decoding).
    """
    check_hashable(request_id, "request_id")
    if request_id not in engine.requests:
        raise KeyError(f"take_prefilled: no request with id {request_id!r}")
    seqs = engine.requests[request_id]
    if len(seqs) != 1:
        raise ValueError(f"take_prefilled: request {request_id!r} has {len(seqs)} samples; only one can move")
    seq = seqs[0]
    if seq not in engine.scheduler.running or seq.num_output_tokens != 1 or seq.num_uncomputed_tokens != 1:
        raise ValueError(f"take_prefilled: request {request_id!r} must be running with its prompt computed and "
                         f"exactly its first token sampled, got {seq!r}")  # fmt: skip
    engine.scheduler.running.remove(seq)
    engine.forget(request_id)
    return seq


def add_prefilled(engine: Engine, seq: Sequence) -> None:
    """Run a request whose K/V another engine computed: it joins ``engine.scheduler.running`` as it is.

    ``seq.block_table`` must already hold its computed tokens' K/V in *this* engine's pool
    (see :func:`transfer_kv`); its next step computes the token after them. Between steps only;
    all checks come first, so an error changes nothing.

    Args:
        engine: the decode engine.
        seq: a running, unfinished :class:`~minipaged.sequence.Sequence` of one sample, whose one
            uncomputed token is its latest output, with a table of this pool holding exactly its
            computed tokens.

    Raises:
        TypeError: ``seq`` is not a Sequence.
        ValueError: its state or table does not fit (another pool, wrong length, released), its id
            is in use, no seat is free (``max_num_seqs``), or it could never fit this pool.
    """
    if not isinstance(seq, Sequence):
        raise TypeError(f"seq must be a Sequence, got {type(seq).__name__}")
    table = seq.block_table
    if (seq.status is not SequenceStatus.RUNNING or seq.pending_forks or seq.num_output_tokens < 1
            or seq.num_uncomputed_tokens != 1):  # fmt: skip
        raise ValueError(f"add_prefilled: seq must be running, one sample, with its latest token uncomputed, "
                         f"got {seq!r}")  # fmt: skip
    if table is None or table.allocator is not engine.cache.allocator or table.released or table.pending_copies:
        raise ValueError(f"add_prefilled: seq {seq.seq_id!r}'s block table must be a live table of this "
                         "engine's pool (transfer its K/V here first)")  # fmt: skip
    if table.num_tokens != seq.num_computed_tokens:
        raise ValueError(f"add_prefilled: seq {seq.seq_id!r}'s table holds {table.num_tokens} tokens but "
                         f"{seq.num_computed_tokens} are computed")  # fmt: skip
    if seq.request_id in engine.requests or seq.seq_id in engine.seqs:
        raise ValueError(f"add_prefilled: request_id {seq.request_id!r} is already in use")
    if engine.scheduler.num_seats >= engine.config.max_num_seqs:
        raise ValueError(f"add_prefilled: no free seat ({engine.config.max_num_seqs} sequences run already)")
    check_fits_pool(engine.config, seq.num_prompt_tokens, seq.sampling_params.max_tokens,
                    f"add_prefilled: request {seq.request_id!r}", "this engine's pool")  # fmt: skip
    engine.scheduler.running.append(seq)
    engine.register([seq])


def transfer_kv(seq: Sequence, src: PagedKVCache, dst: PagedKVCache, match=None) -> BlockTable:
    """Copy a sequence's computed K/V from its blocks in ``src`` into fresh blocks of ``dst``.

    Allocates ``ceil(num_computed_tokens / block_size)`` blocks in ``dst`` (a new table for
    the sequence, holding its computed tokens), copies every layer's K and V of the source
    blocks into them, and returns the new table. The source table is not touched: the caller
    frees it (``release()``) when the transfer is over, and points ``seq.block_table`` at the
    new one. All or nothing: if ``dst`` is short of blocks, :class:`~minipaged.blocks.OutOfBlocks`
    is raised and nothing changed; if the copy itself fails, the new blocks are given back (every
    reference count is as before; the free queue's order may differ, and a cached block evicted
    to make room stays evicted). The K/V goes through host memory, so the two pools may live on
    different devices.

    With a ``match`` (a prefix hit in ``dst``'s own prefix cache), the new table starts with the
    matched blocks, shared as at admission, and only the blocks after them are allocated and copied.

    Args:
        seq: a sequence whose ``block_table`` is a live table of ``src`` holding its computed tokens.
        src: the pool its K/V is in.
        dst: the pool to copy it to; same layers, block size, KV heads, head size and dtype as ``src``.
        match: None, or ``dst.allocator.match_prefix(seq.token_ids, seq.cache_salt)`` made just before
            (:class:`~minipaged.prefix_cache.PrefixMatch`), covering at most the computed tokens.
    """
    if not isinstance(seq, Sequence):
        raise TypeError(f"seq must be a Sequence, got {type(seq).__name__}")
    for name, cache in (("src", src), ("dst", dst)):
        if not isinstance(cache, PagedKVCache):
            raise TypeError(f"{name} must be a PagedKVCache, got {type(cache).__name__}")
    if src is dst:
        raise ValueError("src and dst must be two pools (a transfer inside one pool is a fork)")
    for attr in ("num_layers", "block_size", "num_kv_heads", "head_dim", "dtype"):
        if getattr(src, attr) != getattr(dst, attr):
            raise ValueError(f"src and dst must have the same {attr}: {getattr(src, attr)} and {getattr(dst, attr)}")
    table = seq.block_table
    if table is None or table.allocator is not src.allocator or table.released:
        raise ValueError(f"seq {seq.seq_id!r}'s block table must be a live table of src")
    n = seq.num_computed_tokens
    if n < 1 or table.num_tokens < n or table.pending_copies:
        raise ValueError(f"seq {seq.seq_id!r} must have computed K/V in its table to move (computed {n}, "
                         f"table {table.num_tokens} tokens, {len(table.pending_copies)} copies pending)")  # fmt: skip
    hit = 0
    if match is not None:
        if not hasattr(dst.allocator, "share_prefix"):
            raise ValueError("match needs a dst pool with prefix caching (a PrefixCachingAllocator)")
        if match.num_tokens > n:
            raise ValueError(f"match covers {match.num_tokens} tokens but seq {seq.seq_id!r} has {n} computed")
        hit = len(match.block_ids)
    num_new = blocks_needed(n, src.block_size) - hit
    free = dst.allocator.num_free - (dst.allocator.num_free_among(match.block_ids) if hit else 0)
    if num_new > free:  # checked before sharing anything, so a refusal changes nothing
        raise OutOfBlocks(f"moving {n} tokens needs {num_new} blocks in dst but only {free} are free")
    saved = swap_out(src, table.blocks[hit : hit + num_new])  # read first: nothing has changed if this fails
    new = dst.new_table(seq.seq_id)
    with dst.allocator.hold_events():  # subscribers hear of the new table once it holds every block
        if match is not None:
            dst.allocator.share_prefix(new, match)  # raises for a stale match, before anything changed
        new.append_tokens(n - new.num_tokens)
    try:
        swap_in(dst, new.blocks[hit:], saved)
    except BaseException:
        new.release()
        raise
    return new


@dataclass
class _Arrival:
    time: float
    request_id: object
    prompt: list[int]
    params: SamplingParams
    cache_salt: str | bytes | None


@dataclass
class DisaggStepOutput:
    """What one :meth:`DisaggregatedEngine.step` did.

    Attributes:
        kind: the event: ``"arrive"``, ``"transfer_start"``, ``"transfer_end"``, ``"prefill"`` or ``"decode"``.
        time: when it happened (shared virtual time; an engine step's end).
        request_ids: the requests it concerned (the arrival, the transfer, or those the step computed).
        engine_output: the prefill or decode engine's :class:`~minipaged.engine.StepOutput`, for a step.
        outputs: requests that finished in it (a request asking for one token finishes in the prefill engine).
    """

    kind: str
    time: float
    request_ids: list = field(default_factory=list)
    engine_output: StepOutput | None = None
    outputs: list[RequestOutput] = field(default_factory=list)


EVENT_ORDER = ("transfer_end", "arrive", "transfer_start", "prefill", "decode")  # ties at one instant, in this order


class DisaggregatedEngine:
    """A prefill engine and a decode engine with their own pools and clocks, and a KV link between them.

    Args:
        model: the model both engines run (one copy of the weights in this process; two GPUs in the model).
        prefill_config: the prefill engine's pool and knobs (:class:`EngineConfig` defaults if None).
        decode_config: the decode engine's (defaults if None); same ``block_size`` as the prefill engine's.
        link: the :class:`KVLink` (defaults if None).
        prefill_clock, decode_clock: each engine's :class:`~minipaged.clock.VirtualClock` (new ones if None).
        prefill_allocator, decode_allocator: each engine's allocator class (the ``allocator`` seam of
            :class:`~minipaged.engine.Engine`); both cache prefixes by default.

    Public state: ``prefill`` and ``decode`` (the two :class:`~minipaged.engine.Engine`), ``link``,
    ``waiting_transfer`` (requests with their first token, not yet moving: (seq, ready time)),
    ``in_flight`` (:class:`KVTransfer` on the link, in end order) and ``transfers`` (every finished
    transfer's record, without its sequence).
    """

    def __init__(self, model, prefill_config: EngineConfig | None = None, decode_config: EngineConfig | None = None,
                 link: KVLink | None = None, prefill_clock: VirtualClock | None = None,
                 decode_clock: VirtualClock | None = None, *, prefill_allocator=PrefixCachingAllocator,
                 decode_allocator=PrefixCachingAllocator):  # fmt: skip
        for name, config in (("prefill_config", prefill_config), ("decode_config", decode_config)):
            if config is not None and not isinstance(config, EngineConfig):
                raise TypeError(f"{name} must be an EngineConfig, got {type(config).__name__}")
        if link is not None and not isinstance(link, KVLink):
            raise TypeError(f"link must be a KVLink, got {type(link).__name__}")
        for name, clock in (("prefill_clock", prefill_clock), ("decode_clock", decode_clock)):
            if clock is not None and not isinstance(clock, VirtualClock):
                raise TypeError(f"{name} must be a VirtualClock (on the wall clock two engines sharing the same CPU "
                                f"cores would decouple nothing), got {type(clock).__name__}")  # fmt: skip
        if prefill_clock is not None and prefill_clock is decode_clock:
            raise ValueError("prefill_clock and decode_clock must be two clocks: each engine keeps its own time")
        prefill_config, decode_config = prefill_config or EngineConfig(), decode_config or EngineConfig()
        if prefill_config.block_size != decode_config.block_size:
            raise ValueError(f"prefill_config.block_size ({prefill_config.block_size}) and decode_config.block_size "
                             f"({decode_config.block_size}) must be equal: a transfer moves whole blocks")  # fmt: skip
        self.prefill = Engine(model, prefill_config, prefill_clock or VirtualClock(), allocator=prefill_allocator)
        self.decode = Engine(model, decode_config, decode_clock or VirtualClock(), allocator=decode_allocator)
        start = max(self.prefill.clock.now(), self.decode.clock.now())
        self.prefill.clock.wait_until(start)
        self.decode.clock.wait_until(start)
        self.link = link or KVLink()
        self.link_free_at = start  # the link carries one transfer at a time
        self.arrivals: deque[_Arrival] = deque()  # requests added with a later arrival time, in arrival order
        self.waiting_transfer: deque[tuple[Sequence, float]] = deque()
        self.in_flight: deque[KVTransfer] = deque()
        self.transfers: list[KVTransfer] = []
        # An engine whose last step found nothing it could run waits for a transfer to end: the prefill engine for
        # the source blocks it frees, the decode engine (whose preempted requests cannot come back while transfers
        # hold its blocks) for the request it brings.
        self.prefill_stalled = False
        self.decode_stalled = False
        self._params: dict = {}  # request_id -> the SamplingParams asked for (the prefill engine gets <= 2 tokens)
        self._next_id = 0

    # -- requests ---------------------------------------------------------

    def now(self) -> float:
        """The earlier of the two engines' clocks: everything before it has happened."""
        return min(self.prefill.clock.now(), self.decode.clock.now())

    def _in_use(self, request_id) -> bool:
        return (request_id in self._params or request_id in self.prefill.requests
                or request_id in self.decode.requests)  # fmt: skip

    def add_request(self, prompt_token_ids: list[int], sampling_params: SamplingParams | None = None,
                    request_id=None, arrival_time: float | None = None,
                    cache_salt: str | bytes | None = None):  # fmt: skip
        """Queue a request for the prefill engine; returns its id. Every check is made now, so an error changes nothing.

        Args:
            prompt_token_ids: the prompt, token ids in ``[0, vocab_size)``.
            sampling_params: how to sample and when to stop (:class:`SamplingParams` defaults if None); ``n`` must be 1.
            request_id: any hashable id not in use; None picks the next free integer.
            arrival_time: when it arrives, in the shared virtual time (None: now); it reaches the
                prefill engine then.
            cache_salt: the prefix cache's salt (str or bytes; None: no salt).
        """
        if request_id is None:
            while self._in_use(self._next_id):
                self._next_id += 1
            request_id = self._next_id
        elif self._in_use(check_hashable(request_id, "request_id")):
            raise ValueError(f"request_id {request_id!r} is already in use")
        # The engine's own checks (prompt, parameters, salt), on the request as it will arrive; nothing is queued.
        seq = self.prefill.make_request(prompt_token_ids, sampling_params, request_id, None, cache_salt)[0]
        params, prompt, cache_salt = sampling_params or SamplingParams(), seq.prompt_token_ids, seq.cache_salt
        if params.n != 1:
            raise ValueError(f"sampling_params.n must be 1 in disaggregated serving (each sample would need its own "
                             f"copy of the prompt's blocks), got {params.n}")  # fmt: skip
        arrival = self.now() if arrival_time is None else check_real(arrival_time, "arrival_time")
        name = f"request {request_id!r}"
        check_fits_pool(self.prefill.config, len(prompt), min(params.max_tokens, 2), name, "the prefill engine's pool")
        check_fits_pool(self.decode.config, len(prompt), params.max_tokens, name, "the decode engine's pool")
        entry = _Arrival(arrival, request_id, prompt, params, cache_salt)
        i = len(self.arrivals)  # keep arrival order; equal times keep the order they were added in
        while i > 0 and self.arrivals[i - 1].time > arrival:
            i -= 1
        self.arrivals.insert(i, entry)
        self._params[request_id] = params
        if request_id == self._next_id:
            self._next_id += 1
        return request_id

    def abort(self, request_id) -> None:
        """Drop an unfinished request wherever it is; every block it holds, in either pool, is freed now.

        Not yet arrived: it never will. In the prefill or the decode engine: that engine aborts it
        (:meth:`Engine.abort <minipaged.engine.Engine.abort>`). Waiting for its transfer: its prefill
        blocks are freed. On the link: its blocks in both pools are freed (the link stays busy until
        the transfer would have ended: the bytes are already on their way).

        Raises:
            TypeError: ``request_id`` is not hashable.
            KeyError: no unfinished request has this id.
        """
        if check_hashable(request_id, "request_id") not in self._params:
            raise KeyError(f"abort: no unfinished request with id {request_id!r}")
        for i, a in enumerate(self.arrivals):
            if a.request_id == request_id:
                del self.arrivals[i]
                break
        else:
            if request_id in self.prefill.requests:
                self.prefill.abort(request_id)
            elif request_id in self.decode.requests:
                self.decode.abort(request_id)
            else:
                self._abort_in_transit(request_id)
        del self._params[request_id]

    def _abort_in_transit(self, request_id) -> None:
        for i, (seq, _) in enumerate(self.waiting_transfer):
            if seq.request_id == request_id:
                del self.waiting_transfer[i]
                tables = [seq.block_table]
                break
        else:
            i, transfer = next((i, t) for i, t in enumerate(self.in_flight) if t.request_id == request_id)
            del self.in_flight[i]
            seq, tables = transfer.seq, [transfer.src_table, transfer.dst_table]
        seq.abort()
        seq.block_table = None
        for table in tables:
            table.release()
        self.prefill_stalled = self.decode_stalled = False  # either may have been waiting for these blocks

    def has_unfinished(self) -> bool:
        return bool(self.arrivals or self.waiting_transfer or self.in_flight or self.prefill.has_unfinished()
                    or self.decode.has_unfinished())  # fmt: skip

    # -- events -----------------------------------------------------------

    def _can_start_transfer(self) -> bool:
        """Would the decode engine take the oldest waiting request now (a seat, room, nobody it preempted waiting)?"""
        if not self.waiting_transfer or self.decode.scheduler.waiting:
            return False
        seq, _ = self.waiting_transfer[0]
        # The decode engine's own admission rule; a request on the link has its seat already.
        return self.decode.scheduler.fits(seq, seq.num_computed_tokens + 1, self._decode_hit(seq), len(self.in_flight))

    def _decode_hit(self, seq: Sequence):
        """The decode pool's own cached prefix of ``seq`` (None without prefix caching there): those blocks stay."""
        return self.decode.scheduler.match_prefix(seq)

    def next_event(self) -> tuple[float, str] | None:
        """The earliest thing that can happen next, ``(time, kind)``, or None when nothing can."""
        events = []
        if self.in_flight:
            events.append((self.in_flight[0].end_time, "transfer_end"))
        if self.arrivals:
            events.append((self.arrivals[0].time, "arrive"))
        if self._can_start_transfer():
            events.append((max(self.waiting_transfer[0][1], self.decode.clock.now()), "transfer_start"))
        if self.prefill.has_unfinished() and not self.prefill_stalled:
            events.append((self.prefill.clock.now(), "prefill"))
        if self.decode.has_unfinished() and not self.decode_stalled:
            events.append((self.decode.clock.now(), "decode"))
        return min(events, key=lambda e: (e[0], EVENT_ORDER.index(e[1]))) if events else None

    def step(self) -> DisaggStepOutput | None:
        """Process the earliest next event (see :meth:`next_event`); None when there is none.

        Each event is all or nothing: an engine step rolls itself back (see
        :meth:`Engine.step <minipaged.engine.Engine.step>`), and the others check everything
        before they change anything.
        """
        event = self.next_event()
        if event is None:
            return None
        time, kind = event
        return getattr(self, f"_{kind}")(time)

    def _arrive(self, time: float) -> DisaggStepOutput:
        a = self.arrivals[0]
        first = min(a.params.max_tokens, 2)  # the prefill engine stops after token 1 (it hands the request over)
        params = replace(a.params, max_tokens=first, min_tokens=min(a.params.min_tokens, first))
        # An idle or stalled prefill engine's clock lags: it gets to the arrival first (a busy one is there already),
        # so the request is never from its future and no latency comes out negative.
        self.prefill.clock.wait_until(time)
        self.prefill.add_request(a.prompt, params, a.request_id, arrival_time=a.time, cache_salt=a.cache_salt)
        self.arrivals.popleft()
        return DisaggStepOutput("arrive", time, [a.request_id])

    def _prefill(self, time: float) -> DisaggStepOutput:
        out = self.prefill.step()
        self.prefill_stalled = not out.scheduled
        moved = []
        for seq_id in out.sampled:
            seq = self.prefill.seqs.get(seq_id)
            if seq is None or seq.is_finished:  # finished in the prefill engine (one token asked, or a stop token)
                continue
            take_prefilled(self.prefill, seq_id)
            asked = self._params[seq.request_id]
            seq.sampling_params = replace(seq.sampling_params, max_tokens=asked.max_tokens, min_tokens=asked.min_tokens)
            self.waiting_transfer.append((seq, out.time))
            moved.append(seq_id)
        for output in out.outputs:  # finished in the prefill engine: it reports the parameters asked for
            output.seqs[0].sampling_params = self._params.pop(output.request_id)
        return DisaggStepOutput("prefill", out.time, moved, out, out.outputs)

    def _transfer_start(self, time: float) -> DisaggStepOutput:
        seq, ready = self.waiting_transfer[0]
        match = self._decode_hit(seq)
        dst_table = transfer_kv(seq, self.prefill.cache, self.decode.cache, match)
        num_hit_blocks = len(match.block_ids) if match else 0
        num_blocks = dst_table.num_blocks - num_hit_blocks
        num_bytes = self.link.num_bytes(num_blocks, self.prefill.cache)
        start = max(time, self.link_free_at)
        end = start + self.link.seconds(num_bytes)
        self.waiting_transfer.popleft()
        self.in_flight.append(KVTransfer(seq.request_id, seq.num_computed_tokens, num_blocks, num_bytes, ready, start,
                                         end, num_hit_blocks, seq, seq.block_table, dst_table))  # fmt: skip
        self.link_free_at = end
        self.decode.clock.wait_until(time)
        return DisaggStepOutput("transfer_start", time, [seq.request_id])

    def _transfer_end(self, time: float) -> DisaggStepOutput:
        transfer = self.in_flight[0]
        seq = transfer.seq
        seq.block_table = transfer.dst_table
        try:
            add_prefilled(self.decode, seq)
        except BaseException:
            seq.block_table = transfer.src_table
            raise
        self.in_flight.popleft()
        transfer.src_table.release()  # the prefill pool gets its blocks back (full prompt blocks stay cached)
        transfer.seq = transfer.src_table = transfer.dst_table = None
        self.transfers.append(transfer)
        self.decode.clock.wait_until(time)  # an idle (or stalled) decode engine starts the request now
        self.decode_stalled = False
        if self.prefill_stalled:  # the prefill engine was waiting for these blocks
            self.prefill_stalled = False
            self.prefill.clock.wait_until(time)
        return DisaggStepOutput("transfer_end", time, [seq.request_id])

    def _decode(self, time: float) -> DisaggStepOutput:
        out = self.decode.step()
        self.decode_stalled = not out.scheduled
        for output in out.outputs:
            del self._params[output.request_id]
        return DisaggStepOutput("decode", out.time, list(out.scheduled), out, out.outputs)

    # -- whole workloads --------------------------------------------------

    def run(self, workload: list[RequestSpec], seed: int = 0, prompts: list[list[int]] | None = None) -> list[Sequence]:
        """Replay a workload to the end; returns its sequences in the workload's order (finished, with timings).

        Each request makes exactly its ``num_output_tokens`` tokens (``ignore_eos=True``, as in
        :class:`~minipaged.replay.Replay`).

        Args:
            workload: the requests, arrival times relative to now.
            seed: the seed of the prompts' token ids (as :class:`~minipaged.replay.Replay`).
            prompts: each request's prompt token ids instead of seeded random ones.
        """
        check_workload(self.decode, workload, prompts)  # the engine's replay checks (the decode pool's size)
        start, vocab = self.now(), self.prefill.model.config.vocab_size

        def add(item):
            i, r = item
            return self.add_request(*workload_request(i, r, vocab, seed, prompts), arrival_time=start + r.arrival_time)

        return self._drain(add_all(add, enumerate(workload), self._unqueue))  # all or none, as Engine.generate

    def generate(self, prompts: list[list[int]], sampling_params: SamplingParams | None = None) -> list[list[int]]:
        """Offline convenience: every prompt arrives now; returns each one's output tokens, in order."""
        ids = add_all(lambda p: self.add_request(p, sampling_params), prompts, self._unqueue)  # all or none
        return [s.output_token_ids for s in self._drain(ids)]

    def _unqueue(self, ids: list) -> None:
        """Take requests that have not arrived yet back out (a failed :meth:`run` or :meth:`generate`)."""
        gone = set(ids)
        self.arrivals = deque(a for a in self.arrivals if a.request_id not in gone)
        for i in ids:
            del self._params[i]

    def _drain(self, ids: list) -> list[Sequence]:
        done = {}
        while self.has_unfinished():
            out = self.step()
            if out is None:  # cannot happen: every request fits the decode pool alone
                raise RuntimeError("DisaggregatedEngine is stuck: unfinished requests but no event can happen")
            for output in out.outputs:
                done[output.request_id] = output.seqs[0]
        return [done[i] for i in ids]


# ---------------------------------------------------------------------------
# measured on the virtual clock: one mixed engine against a prefill engine plus a decode engine
# ---------------------------------------------------------------------------


@dataclass
class Comparison:
    """The same workload served by each setup: latency and throughput summaries, and the raw latencies.

    Attributes:
        summaries: setup name -> :func:`~minipaged.latency.summarize`'s numbers (print with
            :func:`~minipaged.latency.format_summary`), plus ``busy_fraction`` (each engine's share of
            the run spent in steps, a list) and, for the disaggregated setup, ``transfer_ms_mean`` and
            ``transfer_wait_ms_mean``.
        latencies: setup name -> ``{"ttft": [...], "tpot": [...], "e2e": [...]}`` in seconds (for CDFs).
        link: the link the disaggregated setup used.
        engines: setup name -> its engines (``keep_finished``: their ``metrics.history`` holds every step,
            for a plot of step times); the disaggregated setup's are ``[prefill, decode]``.
        transfers: the disaggregated setup's :class:`KVTransfer` records, one per request that moved.
    """

    summaries: dict[str, dict]
    latencies: dict[str, dict[str, list[float]]]
    link: KVLink
    engines: dict[str, list[Engine]] = field(default_factory=dict, repr=False)
    transfers: list[KVTransfer] = field(default_factory=list, repr=False)

    def ratio(self, key: str, setup: str = "disaggregated", baseline: str = "mixed") -> float:
        """``summaries[setup][key] / summaries[baseline][key]``."""
        return self.summaries[setup][key] / self.summaries[baseline][key]

    def describe(self) -> str:
        """The numbers behind the table: each engine's busy share, the transfers, and the disaggregated ratios."""
        lines = []
        for name, summary in self.summaries.items():
            busy = ", ".join(f"{b:.0%}" for b in summary["busy_fraction"])
            lines.append(f"{name:<14} busy {busy}")
        if self.transfers:
            t = self.transfers
            mib = sum(x.num_bytes for x in t) / len(t) / 2**20
            lines.append(f"KV transfers   {len(t)}, {mib:.1f} MiB each on average over "
                         f"{self.link.bandwidth / 1e9:g} GB/s: "
                         f"{1000 * sum(x.end_time - x.start_time for x in t) / len(t):.2f} ms on the link, "
                         f"{1000 * sum(x.wait for x in t) / len(t):.2f} ms waiting for the decode engine")
        for base in [b for b in ("mixed", "2 x mixed") if b in self.summaries]:
            lines.append(f"disaggregated / {base}: TTFT p99 x{self.ratio('ttft_p99', baseline=base):.2f}, "
                         f"TPOT p99 x{self.ratio('tpot_p99', baseline=base):.2f}, "
                         f"throughput x{self.ratio('tokens_per_s', baseline=base):.2f}")
        return "\n".join(lines)


class BusyClock(VirtualClock):
    """A :class:`~minipaged.clock.VirtualClock` that also adds up the seconds its engine spent in steps (``busy``)."""

    def __init__(self, cost: StepCost | None = None):
        super().__init__(cost or StepCost())
        self.busy = 0.0

    def step(self, num_batched_tokens: int, num_context_tokens: int, num_swapped_tokens: int = 0) -> None:
        before = self.t
        super().step(num_batched_tokens, num_context_tokens, num_swapped_tokens)
        self.busy += self.t - before


def compare_disaggregation(model, workload: list[RequestSpec], prefill_blocks: int = 64, decode_blocks: int = 192,
                           block_size: int = 16, max_num_seqs: int = 16, max_num_batched_tokens: int = 256,
                           prefill_max_num_batched_tokens: int | None = None, link: KVLink | None = None,
                           seed: int = 0, data_parallel: bool = True) -> Comparison:  # fmt: skip
    """Serve one workload three ways, on the virtual clock, at equal total KV memory.

    * ``"mixed"``: one engine whose pool is ``prefill_blocks + decode_blocks`` (the brief's baseline:
      same memory, but one GPU's compute);
    * ``"2 x mixed"`` (if ``data_parallel``): two independent mixed engines with pools of
      ``prefill_blocks`` and ``decode_blocks``, requests dealt alternately: same memory *and* the
      same two GPUs as the disaggregated setup, the fair baseline for throughput;
    * ``"disaggregated"``: a prefill engine (``prefill_blocks``) and a decode engine
      (``decode_blocks``) joined by ``link``.

    Every engine gets the same ``block_size``, ``max_num_seqs`` and ``max_num_batched_tokens``, chunked
    prefill and prefix caching (the random prompts share nothing). Deterministic.

    Args:
        model: the model (the tiny random one keeps this to a few seconds).
        workload: the requests; prompts are seeded random ids (``seed``).
        prefill_blocks, decode_blocks: the two pools, in blocks of ``block_size``.
        block_size, max_num_seqs, max_num_batched_tokens: each engine's knobs.
        prefill_max_num_batched_tokens: the prefill engine's own token budget (None: ``max_num_batched_tokens``).
            A mixed engine cannot raise its budget without lengthening the steps its decodes wait for;
            a prefill engine can.
        link: the KV link (:class:`KVLink` defaults if None).
        seed: the prompts' seed.
        data_parallel: also run the ``"2 x mixed"`` setup.
    """
    link = link or KVLink()

    def config(num_blocks, budget=max_num_batched_tokens):
        return EngineConfig(num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                            max_num_batched_tokens=budget, keep_finished=True)  # fmt: skip

    runs = {}  # name -> (seqs, engines)
    mixed = Engine(model, config(prefill_blocks + decode_blocks), BusyClock())
    runs["mixed"] = (mixed.run(workload, progress=False, seed=seed), [mixed])
    if data_parallel:
        vocab = model.config.vocab_size
        prompts = [prompt_token_ids(i, r.num_prompt_tokens, vocab, seed) for i, r in enumerate(workload)]
        halves = [Engine(model, config(prefill_blocks), BusyClock()), Engine(model, config(decode_blocks), BusyClock())]
        seqs = [None] * len(workload)
        for k, engine in enumerate(halves):
            idx = list(range(k, len(workload), 2))
            out = engine.run([workload[i] for i in idx], progress=False, prompts=[prompts[i] for i in idx])
            for i, s in zip(idx, out):
                seqs[i] = s
        runs["2 x mixed"] = (seqs, halves)
    prefill_config = config(prefill_blocks, prefill_max_num_batched_tokens or max_num_batched_tokens)
    disagg = DisaggregatedEngine(model, prefill_config, config(decode_blocks), link, BusyClock(), BusyClock())
    runs["disaggregated"] = (disagg.run(workload, seed=seed), [disagg.prefill, disagg.decode])

    summaries, latencies = {}, {}
    for name, (seqs, engines) in runs.items():
        summary = summarize(seqs)
        summary["busy_fraction"] = [e.clock.busy / summary["duration_s"] for e in engines]
        summaries[name] = summary
        latencies[name] = request_latencies(seqs)
    transfers = disagg.transfers
    if transfers:
        summaries["disaggregated"]["transfer_ms_mean"] = 1000 * sum(t.end_time - t.start_time
                                                                    for t in transfers) / len(transfers)  # fmt: skip
        summaries["disaggregated"]["transfer_wait_ms_mean"] = 1000 * sum(t.wait for t in transfers) / len(transfers)
    return Comparison(summaries, latencies, link, {name: engines for name, (_, engines) in runs.items()}, transfers)
