"""The vLLM half of ``bench vllm``: run inside ``.venv-vllm`` as a script, never imported by minipaged.

    .venv-vllm/bin/python minipaged/bench/_vllm_worker.py REQUEST.json RESULT.json

It needs only vLLM (no minipaged), so the vLLM venv stays vLLM's own. The
request names a Hugging Face checkpoint directory, the engine options, and
batches of token-id prompts, each with its ``max_tokens`` and ``ignore_eos``; each
batch is one ``LLM.generate`` call, in order, so a later batch can hit the prefix
cache an earlier one filled. The result has every request's output token ids,
``num_cached_tokens``, ``finish_reason`` and ``stop_reason``, vLLM's
``vllm:prefix_cache_queries`` and ``vllm:prefix_cache_hits`` counters, each
batch's wall time and CPU time (this process's, all threads), and the number of
torch threads vLLM ran with.

The options are the ones measured to work with vLLM's CPU build:
``block_size=32`` (its CPU attention needs it), an explicit
``kv_cache_memory_bytes`` (the default asks for 92% of RAM), ``enforce_eager``
with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (starts in seconds, in this process),
and ``skip_tokenizer_init`` with token-id prompts (the course model's tokenizer
is bytes, which vLLM does not need to know).

How vLLM 0.32 stops at the EOS without a tokenizer: the request's own EOS
(``SamplingParams.eos_token_id``) comes from the tokenizer, so here it is None.
But the engine also reads the checkpoint's generation config
(``generation_config.json``, else ``config.json``) and, unless ``ignore_eos``,
adds its ``eos_token_id`` to the request's stop token ids. So the EOS still
stops the request with ``finish_reason == "stop"``; it is reported as a stop
token (``stop_reason`` is the EOS id), where a tokenizer's EOS reports None.
No ``stop_token_ids`` need to be passed.
"""

import json
import os
import sys
import time

# Run as a script, this file's folder is sys.path[0], and its neighbour vllm.py would shadow vLLM.
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]


def main(request_path: str, result_path: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    request = json.loads(open(request_path).read())
    t0 = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=request["model"],
        skip_tokenizer_init=True,
        dtype=request["dtype"],
        block_size=request["block_size"],
        kv_cache_memory_bytes=request["kv_cache_memory_bytes"],
        enable_prefix_caching=request["enable_prefix_caching"],
        max_num_seqs=request["max_num_seqs"],
        max_num_batched_tokens=request["max_num_batched_tokens"],
        max_model_len=request["max_model_len"],
        enforce_eager=True,
        disable_log_stats=False,  # the prefix-cache counters
        seed=0,
    )
    startup = time.perf_counter() - t0
    batches = []
    for batch in request["batches"]:
        params = [
            SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=r["ignore_eos"], detokenize=False)
            for r in batch
        ]
        t, cpu = time.perf_counter(), time.process_time()
        outputs = llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in batch], params, use_tqdm=False)
        seconds, cpu_seconds = time.perf_counter() - t, time.process_time() - cpu
        batches.append({
            "seconds": seconds,
            "cpu_seconds": cpu_seconds,
            "outputs": [{"token_ids": list(o.outputs[0].token_ids), "num_cached_tokens": o.num_cached_tokens,
                         "finish_reason": o.outputs[0].finish_reason, "stop_reason": o.outputs[0].stop_reason}
                        for o in outputs],
        })  # fmt: skip
    counters = {m.name: m.value for m in llm.get_metrics() if m.name.startswith("vllm:prefix_cache")}
    import torch

    result = {"vllm_version": vllm.__version__, "startup_seconds": startup, "batches": batches, "counters": counters,
              "threads": torch.get_num_threads()}
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
