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
    assert "--random-prefix-len" not in cmd
    # prefix caching: 896 of the 1,500 tokens every prompt shares, 604 random
    cached = engines.bench_command(hf_id="Qwen/Qwen3-8B", request_rate_per_s=8,
                                   num_prompts=200, prompt_tokens=1500,
                                   output_tokens=200, ttft_p99_s=1.0, itl_p99_s=0.05,
                                   cached_tokens=896.0)
    assert "--dataset-name random --random-prefix-len 896 --random-input-len 604 " in (
        cached)


def _cli(name: str, weights: str, kv: str) -> str:
    return engines.command_line(engines.flags(
        name, tensor_parallel=1, concurrency=64, token_budget=2048,
        gpu_memory_utilization=0.9, memory_bytes=H100,
        weight_bytes=8.19e9 * {"bf16": 2, "fp8": 1}.get(weights, 0.5625),
        weight_dtype=weights, kv_dtype=kv))


def test_fp8_weights_and_kv_cache_in_each_engines_words():
    assert _cli("vllm", "fp8", "fp8") == (
        "--tensor-parallel-size 1 --max-num-seqs 64 --max-num-batched-tokens 2048 "
        "--quantization fp8 --kv-cache-dtype fp8 --gpu-memory-utilization 0.9")
    assert _cli("sglang", "fp8", "fp8") == (
        "--tp-size 1 --max-running-requests 64 --chunked-prefill-size 2048 "
        "--quantization fp8 --kv-cache-dtype fp8_e5m2 --mem-fraction-static 0.9")
    # 8.19 GB of FP8 weights: (72 - 8.19) / (80 - 8.19) of what they leave
    assert _cli("trtllm", "fp8", "fp8") == (
        "--tp_size 1 --max_batch_size 64 --max_num_tokens 2048 --kv_cache_dtype fp8 "
        "--kv_cache_free_gpu_memory_fraction 0.8886")
    # an FP8 cache beside bf16 weights; bf16 adds nothing
    assert _cli("vllm", "bf16", "fp8") == (
        "--tensor-parallel-size 1 --max-num-seqs 64 --max-num-batched-tokens 2048 "
        "--kv-cache-dtype fp8 --gpu-memory-utilization 0.9")
    assert "quantization" not in _cli("sglang", "bf16", "bf16")
    assert "dtype" not in _cli("trtllm", "bf16", "bf16")
    assert engines.notes("vllm", "fp8") == engines.notes("sglang", "fp8") == []
    assert engines.notes("vllm", "bf16") == engines.notes("trtllm", "bf16") == []
    assert engines.notes("trtllm", "fp8") == [
        "fp8 weights: TensorRT-LLM has no flag that quantises to fp8 as the model "
        "loads; serve an FP8 checkpoint of NVIDIA ModelOpt, whose config it reads"]


def test_four_bit_weights_need_a_checkpoint_except_sglangs_int4():
    assert _cli("sglang", "int4", "bf16") == (
        "--tp-size 1 --max-running-requests 64 --chunked-prefill-size 2048 "
        "--torchao-config int4wo-128 --mem-fraction-static 0.9")
    assert engines.notes("sglang", "int4") == []
    assert _cli("vllm", "int4", "bf16") == (
        "--tensor-parallel-size 1 --max-num-seqs 64 --max-num-batched-tokens 2048 "
        "--gpu-memory-utilization 0.9")
    assert engines.notes("vllm", "int4") == [
        "int4 weights: vLLM has no flag that quantises to int4 as the model loads; "
        "serve a GPTQ or AWQ checkpoint (4-bit, group size 128), whose config it "
        "reads"]
    assert engines.notes("vllm", "fp4") == [
        "fp4 weights: vLLM has no flag that quantises to fp4 as the model loads; "
        "serve an NVFP4 checkpoint (NVIDIA ModelOpt or llm-compressor), whose "
        "config it reads"]
    assert engines.notes("sglang", "fp4") == [
        "fp4 weights: SGLang has no flag that quantises to fp4 as the model loads; "
        "serve an NVFP4 checkpoint (NVIDIA ModelOpt), whose config it reads"]
    assert engines.notes("trtllm", "int4") == [
        "int4 weights: TensorRT-LLM has no flag that quantises to int4 as the model "
        "loads; serve a W4A16 AWQ checkpoint of NVIDIA ModelOpt, whose config it "
        "reads"]
    assert "--quantization" not in _cli("vllm", "fp4", "fp8")


def test_every_engine_names_a_way_to_every_quantised_dtype():
    """A flag, or a checkpoint to serve: never neither (nor both)."""
    from sweep.model import precision

    for name, e in engines.ENGINES.items():
        for w in precision.WEIGHT_DTYPES[1:]:
            assert (w in e.weight_quantization) != (w in e.checkpoints), (name, w)
        for kv in precision.KV_DTYPES[1:]:
            assert kv in e.kv_cache_dtype, (name, kv)


def test_optimize_report_shows_each_engines_notes():
    from sweep.report.markdown import engine_lines

    lines = engine_lines({"vllm_flags": "--quantization fp8",
                          "trtllm_flags": "--tp_size 1",
                          "trtllm_notes": "fp8 weights: serve a checkpoint"})
    assert lines == ["* vLLM flags: `--quantization fp8`",
                     "* TensorRT-LLM flags: `--tp_size 1`; fp8 weights: serve a "
                     "checkpoint"]


def test_prefix_caching_flags():
    """vLLM: --enable-prefix-caching, a flag alone; SGLang's radix cache and
    TensorRT-LLM's block reuse are on by default: a note, no flag."""
    from sweep.cube import engines

    common = dict(tensor_parallel=1, concurrency=8, token_budget=2048,
                  gpu_memory_utilization=None)
    on = engines.flags("vllm", prefix_caching=True, **common)
    assert engines.command_line(on) == (
        "--tensor-parallel-size 1 --max-num-seqs 8 --max-num-batched-tokens 2048 "
        "--enable-prefix-caching")
    assert "--enable-prefix-caching" not in engines.flags("vllm", **common)
    for name in ("sglang", "trtllm"):
        assert engines.flags(name, prefix_caching=True, **common) == engines.flags(
            name, **common)
        assert len(engines.notes(name, prefix_caching=True)) == 1
        assert engines.notes(name) == []
    assert engines.notes("vllm", prefix_caching=True) == []


def test_disaggregated_pool_flags_by_engine():
    """Each engine's pool flags and front, written from its docs: vLLM's
    KVTransferConfig roles, SGLang's ``--disaggregation-mode`` and router,
    TensorRT-LLM's cache transceiver YAML and ``trtllm-serve disaggregated``."""
    line = {(e, pool): engines.command_line(engines.pool_flags(e, pool))
            for e in engines.ENGINES for pool in ("prefill", "decode")}
    assert line["vllm", "prefill"] == (
        """--kv-transfer-config '{"kv_connector":"NixlConnector","""
        """"kv_role":"kv_producer"}'""")
    assert line["vllm", "decode"].endswith(""""kv_role":"kv_consumer"}'""")
    assert line["sglang", "prefill"] == (
        "--disaggregation-mode prefill --disaggregation-transfer-backend nixl")
    assert line["sglang", "decode"] == (
        "--disaggregation-mode decode --disaggregation-transfer-backend nixl")
    assert line["trtllm", "prefill"] == line["trtllm", "decode"] == ""
    vllm = engines.pool_note("vllm", 1, 3)
    assert "to a prefill instance (1 here) with max_tokens 1, then to a decode " \
        "instance (3 here)" in vllm
    sglang = engines.pool_note("sglang", 2, 3)
    assert sglang.startswith("a router in front: python -m "
                             "sglang_router.launch_router --pd-disaggregation")
    assert "one --prefill per prefill instance (2)" in sglang
    assert "one --decode per decode instance (3)" in sglang
    trt = engines.pool_note("trtllm", 2, 3, 40960)
    for part in ("cache_transceiver_config: {backend: UCX, "
                 "max_tokens_in_buffer: 40960}",
                 "disable_overlap_scheduler: true",
                 "trtllm-serve disaggregated -c disagg_config.yaml",
                 "context_servers: {num_instances: 2, urls: [...]}",
                 "generation_servers: {num_instances: 3, urls: [...]}"):
        assert part in trt
    assert "max_tokens_in_buffer: N}" in engines.pool_note("trtllm", 2, 3)
    # a layer-wise connector: vLLM's LMCache connector with use_layerwise (its
    # save_kv_layer); the others send after the prefill, and say so
    layered = engines.command_line(engines.pool_flags("vllm", "decode", True))
    assert layered == (
        """--kv-transfer-config '{"kv_connector":"LMCacheConnectorV1","""
        """"kv_role":"kv_consumer","kv_connector_extra_config":"""
        """{"use_layerwise":true}}'""")
    # (their own are open pull requests, named)
    for e, proposal in (("sglang", "sgl-project/sglang#28529"),
                        ("trtllm", "NVIDIA/TensorRT-LLM#15727")):
        same = engines.pool_flags(e, "prefill")
        assert engines.pool_flags(e, "prefill", True) == same
        note = engines.pool_note(e, 1, 1, None, True)
        assert ("the layer-wise overlap planned here (hardware.kv_transfer_layerwise) "
                "is vLLM's LMCacheConnectorV1 with use_layerwise (") in note
        assert note.endswith(f"is an open pull request, {proposal}, not in a release)")
    vllm = engines.pool_note("vllm", 1, 1)
    assert engines.pool_note("vllm", 1, 1, None, True) == vllm
    with pytest.raises(ValueError, match="pool='both': allowed: prefill, decode"):
        engines.pool_flags("vllm", "both")
