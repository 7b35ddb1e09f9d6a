"""Serving-engine flags and the benchmark command, against hand calculations."""

from __future__ import annotations

import pytest

from sweep.cube import engines
from sweep.errors import ConfigError

H100 = 80e9  # bytes per GPU (conf/hardware/h100_sxm.yaml)
QWEN3_8B = 8.19e9 * 2  # bf16 weight bytes


def test_vllm_and_sglang_take_the_same_memory_share():
    common = dict(tensor_parallel=2, concurrency=64, token_budget=2048,
                  gpu_memory_utilization=0.9)
    assert engines.flags("vllm", **common) == {
        "--tensor-parallel-size": 2, "--max-num-seqs": 64,
        "--max-num-batched-tokens": 2048, "--gpu-memory-utilization": 0.9}
    assert engines.flags("sglang", **common) == {
        "--tp-size": 2, "--max-running-requests": 64,
        "--chunked-prefill-size": 2048, "--mem-fraction-static": 0.9}


def test_trtllm_memory_fraction_is_of_what_the_weights_leave():
    # TP 1: KV = 0.9 * 80 GB - 16.38 GB = 55.62 GB of the 63.62 GB left
    one = engines.flags("trtllm", tensor_parallel=1, concurrency=64,
                        token_budget=2048, gpu_memory_utilization=0.9,
                        memory_bytes=H100, weight_bytes=QWEN3_8B)
    assert one == {"--tp_size": 1, "--max_batch_size": 64, "--max_num_tokens": 2048,
                   "--kv_cache_free_gpu_memory_fraction": round(55.62 / 63.62, 4)}
    # TP 2: 8.19 GB of weights per GPU; (72 - 8.19) / (80 - 8.19)
    two = engines.flags("trtllm", tensor_parallel=2, concurrency=64,
                        token_budget=2048, gpu_memory_utilization=0.9,
                        memory_bytes=H100, weight_bytes=QWEN3_8B)
    assert two["--kv_cache_free_gpu_memory_fraction"] == 0.8886
    # without the memory sizes the fraction is left to the engine
    bare = engines.flags("trtllm", tensor_parallel=1, concurrency=None,
                         token_budget=None, gpu_memory_utilization=0.9)
    assert bare == {"--tp_size": 1}


def test_command_line_and_unknown_engine():
    assert engines.command_line({"--tp-size": 2, "--mem-fraction-static": 0.85}) == (
        "--tp-size 2 --mem-fraction-static 0.85")
    with pytest.raises(ConfigError, match=r"engine='tgi': unknown engine; allowed: "
                       r"vllm, sglang, trtllm"):
        engines.flags("tgi", tensor_parallel=1, concurrency=1, token_budget=1,
                      gpu_memory_utilization=0.9)


def test_bench_command():
    cmd = engines.bench_command(hf_id="Qwen/Qwen3-8B", request_rate_per_s=1.5,
                                num_prompts=1000, prompt_tokens=1203.6,
                                output_tokens=359.5, ttft_p99_s=1.0, itl_p99_s=0.05)
    assert cmd.startswith(
        "vllm bench serve --model Qwen/Qwen3-8B --dataset-name random")
    for part in ("--random-input-len 1204", "--random-output-len 360",
                 "--num-prompts 1000", "--request-rate 1.5",
                 "--goodput ttft:1000 tpot:50", "--metric-percentiles 50,99",
                 "--save-result --save-detailed"):
        assert part in cmd
