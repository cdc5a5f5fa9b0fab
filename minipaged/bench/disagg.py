"""``python -m minipaged.bench disagg``: prefill/decode disaggregation against mixed engines, as the load rises.

For each arrival rate, one workload (:data:`minipaged.disagg.DISAGG_PRESET`: long prompts, short
answers) is served three ways at equal total KV memory (:func:`minipaged.disagg.compare_disaggregation`):
one mixed engine with both pools, two mixed engines with one pool each (the same two GPUs), and a
prefill engine plus a decode engine joined by a KV link. Then, at one rate, the link's bandwidth
is swept: a slow link makes every request's second token wait for its K/V.

Time is the virtual clock's only (:mod:`minipaged.clock`): on the wall clock two engines in one
process on the same CPU cores never run at the same time, so disaggregation could decouple
nothing. The script prints the TTFT and TPOT ratios (mixed / disaggregated: how many times
shorter) and the throughput ratios (disaggregated / baseline); last, it times the disaggregated
run's engine steps on the wall clock, to show that they take turns (their seconds add up to the
run's), where the virtual clock lets the two engines' busy time overlap.
"""

from __future__ import annotations

import argparse
import time

import torch

from minipaged.cli import positive_int, positive_rate
from minipaged.disagg import DISAGG_PRESET, BusyClock, DisaggregatedEngine, KVLink, compare_disaggregation
from minipaged.model import LlamaConfig, LlamaForCausalLM
from minipaged.scheduler import EngineConfig
from minipaged.sequence import SamplingParams
from minipaged.workload import make_workload, prompt_token_ids

SETUPS = ("mixed", "2 x mixed", "disaggregated")


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m minipaged.bench disagg", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=positive_int, default=48, help="requests per workload")
    parser.add_argument("--rates", type=positive_rate, nargs="+", default=[6.0, 12.0, 18.0, 24.0, float("inf")],
                        help="Poisson arrivals per second, one workload each (inf: all at once)")
    parser.add_argument("--prefill-blocks", type=positive_int, default=64)
    parser.add_argument("--decode-blocks", type=positive_int, default=192)
    parser.add_argument("--block-size", type=positive_int, default=16)
    parser.add_argument("--max-num-seqs", type=positive_int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=256)
    parser.add_argument("--bandwidths", type=positive_rate, nargs="+", default=[1e9, 5e9, 25e9, 100e9],
                        help="link bandwidths (bytes/s) swept at the rate --sweep-rate")
    parser.add_argument("--sweep-rate", type=positive_rate, default=18.0)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = _parse(argv)
    torch.set_grad_enabled(False)
    torch.set_num_threads(1)
    model = LlamaForCausalLM(LlamaConfig(), seed=args.seed).eval()
    knobs = {"prefill_blocks": args.prefill_blocks, "decode_blocks": args.decode_blocks,
             "block_size": args.block_size, "max_num_seqs": args.max_num_seqs,
             "max_num_batched_tokens": args.max_num_batched_tokens, "seed": args.seed}  # fmt: skip
    total = args.prefill_blocks + args.decode_blocks
    print(f"workload: {args.requests} requests, preset {DISAGG_PRESET.name} (prompt {DISAGG_PRESET.prompt_len}, "
          f"output {DISAGG_PRESET.output_len}), seed {args.seed}; virtual clock")
    print(f"memory: mixed {total} blocks; 2 x mixed {args.prefill_blocks} + {args.decode_blocks}; disaggregated "
          f"prefill {args.prefill_blocks} + decode {args.decode_blocks} (block_size {args.block_size})\n")
    _rate_table(model, args, knobs)
    workload = make_workload(args.requests, args.sweep_rate, DISAGG_PRESET, args.seed)
    _bandwidth_sweep(model, args, knobs, workload)
    _wall_against_virtual(model, args, workload)
    return 0


def _rate_table(model, args, knobs: dict) -> None:
    """Mixed, 2 x mixed and disaggregated at each arrival rate: latencies, throughput, the engines' busy time."""
    header = f"{'rate/s':>7} {'setup':>14} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} {'tok/s':>7}"
    print(header + "   (latencies in ms)")
    for rate in args.rates:
        cmp = compare_disaggregation(model, make_workload(args.requests, rate, DISAGG_PRESET, args.seed), **knobs)
        for name in SETUPS:
            s = cmp.summaries[name]
            print(f"{rate:>7g} {name:>14} {1000 * s['ttft_p50']:>9.1f} {1000 * s['ttft_p99']:>9.1f} "
                  f"{1000 * s['tpot_p50']:>9.1f} {1000 * s['tpot_p99']:>9.1f} {s['tokens_per_s']:>7.1f}")
        for base in ("mixed", "2 x mixed"):
            print(f"{'':>7} {base} / disaggregated: TTFT p99 {1 / cmp.ratio('ttft_p99', baseline=base):.2f}x, "
                  f"TPOT p99 {1 / cmp.ratio('tpot_p99', baseline=base):.2f}x; throughput disaggregated / {base} "
                  f"{cmp.ratio('tokens_per_s', baseline=base):.2f}x")
        busy = cmp.summaries["disaggregated"]["busy_fraction"]
        print(f"{'':>7} busy: prefill engine {busy[0]:.0%}, decode engine {busy[1]:.0%}\n")


def _bandwidth_sweep(model, args, knobs: dict, workload) -> None:
    """The disaggregated setup at each link bandwidth: transfer time, waiting, and what it does to TPOT."""
    print(f"link bandwidth at {args.sweep_rate:g} requests/s (bytes per token: Llama-2-7B's)")
    for bandwidth in args.bandwidths:
        cmp = compare_disaggregation(model, workload, link=KVLink(bandwidth=bandwidth), data_parallel=False, **knobs)
        s = cmp.summaries["disaggregated"]
        print(f"{bandwidth / 1e9:>7g} GB/s: transfer {s['transfer_ms_mean']:.1f} ms on the link + "
              f"{s['transfer_wait_ms_mean']:.1f} ms waiting, TPOT p50 {1000 * s['tpot_p50']:.1f} ms, "
              f"p99 {1000 * s['tpot_p99']:.1f} ms (mixed: {1000 * cmp.summaries['mixed']['tpot_p99']:.1f} ms)")


def _wall_against_virtual(model, args, workload) -> None:
    """Why the virtual clock: on this machine the two engines take turns, they never overlap."""
    config = {"block_size": args.block_size, "max_num_seqs": args.max_num_seqs,
              "max_num_batched_tokens": args.max_num_batched_tokens}  # fmt: skip
    d = DisaggregatedEngine(model, EngineConfig(num_blocks=args.prefill_blocks, **config),
                            EngineConfig(num_blocks=args.decode_blocks, **config), None, BusyClock(), BusyClock())
    for i, r in enumerate(workload):
        d.add_request(prompt_token_ids(i, r.num_prompt_tokens, model.config.vocab_size, args.seed),
                      SamplingParams(max_tokens=r.num_output_tokens, ignore_eos=True),
                      arrival_time=r.arrival_time)  # fmt: skip
    wall = {"prefill": 0.0, "decode": 0.0}
    start = time.perf_counter()
    while d.has_unfinished():
        kind = d.next_event()[1]
        t0 = time.perf_counter()
        d.step()
        if kind in wall:
            wall[kind] += time.perf_counter() - t0
    total = time.perf_counter() - start
    busy = {"prefill": d.prefill.clock.busy, "decode": d.decode.clock.busy}
    span = max(d.prefill.clock.now(), d.decode.clock.now())
    print(f"\nwall clock, this machine: prefill steps {wall['prefill']:.2f} s + decode steps {wall['decode']:.2f} s "
          f"= {wall['prefill'] + wall['decode']:.2f} s of the run's {total:.2f} s: one after the other, never at once")
    print(f"virtual clock, two GPUs: prefill busy {busy['prefill']:.2f} s and decode busy {busy['decode']:.2f} s "
          f"overlap within a run of {span:.2f} s (busy sum / span = {sum(busy.values()) / span:.2f})")
