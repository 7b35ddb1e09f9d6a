"""Precision as an axis (``sweep.model.precision``): weight and KV bytes with their
group scales, each weight dtype's tensor-core rate, and the refusal of a
dtype a GPU lacks.

Expected values are float64 hand calculations from the figures written out
here (datasheets, ``conf/hardware/b200.yaml``; Qwen3-8B as in
``tests/helpers.py``), not from the code under test.
"""

from __future__ import annotations

import math

import helpers as h
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import xarray as xr
from omegaconf import OmegaConf

import sweep  # noqa: F401  (ds.sweep)
from sweep.config.schema import ConfigError, Grid, Model
from sweep.exported import jit

# bytes per weight: int4 with one bf16 scale per 128 weights, fp4 (NVFP4) with
# one 1-byte FP8 scale per 16
WEIGHT_BYTES = {"bf16": 2.0, "fp8": 1.0, "int4": 0.515625, "fp4": 0.5625}
KV_BYTES = {"bf16": 2.0, "fp8": 1.0}
KV_VALUES = 2 * h.LAYERS * h.KVH * h.HD  # K and V per token: 73,728

# B200 (HGX B200 datasheet, 2025): dense tensor-core FLOP/s by dtype
B200_BW, B200_MEM = 8.0e12, 1.8e11
B200_RATE = {"bf16": 2.25e15, "fp8": 4.5e15, "int4": 2.25e15, "fp4": 9.0e15}


def b200_step(w: str, kv: str, new_tokens, kv_read_tokens, keys) -> float:
    """A B200 step of Qwen3-8B at weight dtype ``w`` and KV dtype ``kv``: the
    linear layers at ``w``'s tensor-core rate, attention at BF16's."""
    memory = (h.PARAMS * WEIGHT_BYTES[w]
              + kv_read_tokens * KV_VALUES * KV_BYTES[kv]) / B200_BW
    compute = (2 * h.PARAMS * new_tokens / B200_RATE[w]
               + h.FPK * keys / B200_RATE["bf16"])
    return max(memory, compute)


@pytest.mark.slow
def test_precision_axes_in_sweep_grid_by_hand(tmp_path):
    proc = h.run_script("sweep-grid", [
        "hardware=b200", "model=qwen3_8b", "workload=seed_chat",
        "grid.tensor_parallel=[1]", "grid.concurrency=[1,64]",
        "grid.token_budget=[2048]", "grid.context_tokens=[1500]",
        "grid.batching=[continuous]", "grid.long_prompt_tokens=[8192]",
        "grid.traffic_tokens_per_day=[1e9]", "grid.weight_dtype=[bf16,fp8,int4,fp4]",
        "grid.kv_dtype=[bf16,fp8]", "calibration=roofline", "out=c.zarr"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    ds = xr.open_zarr(tmp_path / "c.zarr")
    assert list(ds.weight_dtype.values) == ["bf16", "fp8", "int4", "fp4"]
    assert list(ds.kv_dtype.values) == ["bf16", "fp8"]
    prompt = float(ds.mean_prompt_tokens.sel(workload="seed_chat"))
    assert prompt == 1500
    for w in WEIGHT_BYTES:
        assert float(ds.weight_bytes.sel(model="qwen3_8b", weight_dtype=w)) == (
            pytest.approx(h.PARAMS * WEIGHT_BYTES[w], rel=1e-12))
        for kv in KV_BYTES:
            pt = ds.sel(weight_dtype=w, kv_dtype=kv, hardware="b200",
                        model="qwen3_8b", workload="seed_chat", tensor_parallel=1,
                        token_budget=2048, context_tokens=1500,
                        batching="continuous", long_prompt_tokens=8192,
                        traffic_tokens_per_day=1e9, spec_tokens=0,
                        spec_acceptance=0.7, spec_proposer=0, prefix_caching=0,
                        disaggregated=0,
                        prefill_instances=1, decode_instances=1,
                        prefill_tensor_parallel=0)
            for n in (1, 64):
                want = b200_step(w, kv, n, n * 1500, n * 1500)
                got = float(pt.step_s.sel(concurrency=n))
                assert got == pytest.approx(want, rel=2e-6), (w, kv, n)
            # a whole 1,500-token prompt in one step: compute-bound at every dtype
            prefill = b200_step(w, kv, prompt, 0, h.chunk_keys(prompt, 0))
            assert prefill > (h.PARAMS * WEIGHT_BYTES[w]) / B200_BW
            assert float(pt.prefill_tokens_per_s.sel(concurrency=1)) == pytest.approx(
                prompt / prefill, rel=2e-6)
            fit = math.floor((B200_MEM - h.PARAMS * WEIGHT_BYTES[w])
                             / (1500 * KV_VALUES * KV_BYTES[kv]))
            assert float(pt.max_concurrency_fit.sel(concurrency=1)) == fit
    for kv in KV_BYTES:
        assert float(ds.kv_bytes_per_token.sel(model="qwen3_8b", kv_dtype=kv)) == (
            KV_VALUES * KV_BYTES[kv])
    assert ds.weight_dtype.attrs["long_name"].startswith("weight precision")
    # each point's serving flags carry its dtypes (grid.gpu_memory_utilization 1)
    at = dict(hardware="b200", model="qwen3_8b", workload="seed_chat",
              tensor_parallel=1, concurrency=64, token_budget=2048,
              context_tokens=1500, batching="continuous", long_prompt_tokens=8192,
              traffic_tokens_per_day=1e9, spec_tokens=0, spec_acceptance=0.7,
              spec_proposer=0, prefix_caching=0, disaggregated=0,
              prefill_instances=1,
              decode_instances=1, prefill_tensor_parallel=0)
    fp8 = ds.sweep.to_serving_flags(weight_dtype="fp8", kv_dtype="fp8", **at)
    assert fp8.cli == (
        "--tensor-parallel-size 1 --max-num-seqs 64 --max-num-batched-tokens 2048 "
        "--quantization fp8 --kv-cache-dtype fp8 --gpu-memory-utilization 1")
    assert fp8.notes == ()
    fp4 = ds.sweep.to_serving_flags(engine="sglang", weight_dtype="fp4",
                                    kv_dtype="bf16", **at)
    assert fp4.cli == ("--tp-size 1 --max-running-requests 64 --chunked-prefill-size "
                       "2048 --mem-fraction-static 1")
    assert fp4.notes == (
        "fp4 weights: SGLang has no flag that quantises to fp4 as the model loads; "
        "serve an NVFP4 checkpoint (NVIDIA ModelOpt), whose config it reads",)
    trt = ds.sweep.to_serving_flags(engine="trtllm", weight_dtype="int4",
                                    kv_dtype="fp8", **at)
    assert trt.cli == ("--tp_size 1 --max_batch_size 64 --max_num_tokens 2048 "
                       "--kv_cache_dtype fp8 --kv_cache_free_gpu_memory_fraction 1")


@pytest.mark.slow
def test_a_dtype_the_gpu_lacks_is_refused_before_any_work(tmp_path):
    proc = h.run_script("sweep-grid", ["hardware=h100_sxm", "model=qwen3_8b",
                                       "grid.weight_dtype=[bf16,fp4]", "out=c.zarr"],
                        tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "sweep-grid: error: grid.weight_dtype = ['bf16', 'fp4']: hardware[h100_sxm] "
        "has no fp4 tensor cores (hardware.fp4_flops_per_s = 0); allowed on "
        "h100_sxm: bf16, fp8, int4")
    assert list(tmp_path.iterdir()) == []


def test_a_model_dtype_the_gpu_lacks_is_refused(hydra_ctx):
    from sweep.cli.grid import check

    with pytest.raises(ConfigError) as e:
        check("grid", ["hardware=a100_80gb_sxm", "model=qwen3_8b",
                       "model.weight_dtype=fp8"])
    assert str(e.value) == (
        "model[qwen3_8b].weight_dtype = fp8: hardware[a100_80gb_sxm] has no fp8 "
        "tensor cores (hardware.fp8_flops_per_s = 0); allowed on a100_80gb_sxm: "
        "bf16, int4")
    # an FP8 KV cache is storage only: every GPU takes it
    check("grid", ["hardware=a100_80gb_sxm", "model=qwen3_8b", "grid=small",
                   "grid.kv_dtype=[fp8]", "grid.weight_dtype=[int4]"])


@pytest.mark.parametrize("args, message", [
    (["grid.weight_dtype=[fp16]"],
     "grid.weight_dtype = ['fp16']: allowed: bf16, fp8, int4, fp4"),
    (["grid.kv_dtype=[fp8,fp8]"], "grid.kv_dtype = ['fp8', 'fp8']: values must be "
     "distinct"),
    (["model.kv_dtype=int4"], "model[qwen3_8b].kv_dtype = 'int4': allowed: bf16, fp8"),
])
def test_unknown_dtypes_are_refused_in_one_line(hydra_ctx, args, message):
    from sweep.cli.grid import check

    with pytest.raises(ConfigError) as e:
        check("grid", ["hardware=h100_sxm", "model=qwen3_8b", *args])
    assert str(e.value) == message


def test_optimize_excludes_or_refuses_what_the_gpus_lack(hydra_ctx):
    from sweep.search import optimize

    base, hardware, models = optimize.options("optimize", [
        "search.hardware=[a100_80gb_sxm]", "model=qwen3_8b", "model.weight_dtype=fp8"])
    with pytest.raises(ConfigError) as e:
        optimize.prepare(base, hardware, models)
    assert str(e.value) == (
        "model[qwen3_8b].weight_dtype = fp8: no hardware searched has fp8 tensor "
        "cores (hardware.fp8_flops_per_s = 0 on a100_80gb_sxm); allowed: bf16, "
        "int4, or hardware with them")
    base, hardware, models = optimize.options("optimize", [
        "search.hardware=[a100_80gb_sxm,h100_sxm]", "model=qwen3_8b",
        "model.weight_dtype=fp8", "search.tensor_parallel=[1]"])
    job = optimize.prepare(base, hardware, models)
    assert [c.hardware.name for c in job.candidates] == ["h100_sxm"]
    assert "a100_80gb_sxm x qwen3_8b (fp8 weights, bf16 KV): no fp8 tensor cores " \
           "(hardware.fp8_flops_per_s = 0)" in job.excluded


def test_optimize_flags_carry_the_models_dtypes(hydra_ctx):
    from sweep.search import optimize

    job = optimize.prepare(*optimize.options("optimize", [
        "hardware=h100_sxm", "model=qwen3_8b", "model.weight_dtype=fp8",
        "model.kv_dtype=fp8", "search.tensor_parallel=[1]"]))
    c = optimize.Config(0, 64, 2048, 2, {}, 0.0, 0.0)
    assert optimize.serving_flags(job, c, "vllm") == (
        "--tensor-parallel-size 1 --max-num-seqs 64 --max-num-batched-tokens 2048 "
        "--quantization fp8 --kv-cache-dtype fp8 --gpu-memory-utilization 0.9  "
        "(x 2 replicas)")
    # 8.19 GB of FP8 weights: (0.9 x 80 - 8.19) / (80 - 8.19)
    assert optimize.serving_flags(job, c, "trtllm") == (
        "--tp_size 1 --max_batch_size 64 --max_num_tokens 2048 --kv_cache_dtype fp8 "
        "--kv_cache_free_gpu_memory_fraction 0.8886  (x 2 replicas)")
    assert optimize.serving_notes(job, c, "vllm") == []
    assert optimize.serving_notes(job, c, "trtllm") == [
        "fp8 weights: TensorRT-LLM has no flag that quantises to fp8 as the model "
        "loads; serve an FP8 checkpoint of NVIDIA ModelOpt, whose config it reads"]


def test_optimize_searches_the_dtypes(hydra_ctx):
    """``search.weight_dtype`` x ``search.kv_dtype``: one candidate per
    hardware x model x dtypes x TP; a GPU without the tensor cores of a weight
    dtype is left out with one line per pair; a dtype no GPU runs is refused."""
    from sweep.config.convert import model_params
    from sweep.search import optimize

    job = optimize.prepare(*optimize.options("optimize", [
        "search.hardware=[a100_80gb_sxm,h100_sxm]", "model=qwen3_8b",
        "search.weight_dtype=[bf16,fp8]", "search.kv_dtype=[bf16,fp8]",
        "search.tensor_parallel=[1]"]))
    assert [c.label for c in job.candidates] == [
        "a100_80gb_sxm x qwen3_8b x TP 1",
        "a100_80gb_sxm x qwen3_8b (bf16 weights, fp8 KV) x TP 1",
        "h100_sxm x qwen3_8b x TP 1",
        "h100_sxm x qwen3_8b (bf16 weights, fp8 KV) x TP 1",
        "h100_sxm x qwen3_8b (fp8 weights, bf16 KV) x TP 1",
        "h100_sxm x qwen3_8b (fp8 weights, fp8 KV) x TP 1"]
    assert job.excluded == [
        f"a100_80gb_sxm x qwen3_8b (fp8 weights, {kv} KV): no fp8 tensor cores "
        "(hardware.fp8_flops_per_s = 0)" for kv in ("bf16", "fp8")]
    fp8 = model_params(job.candidates[-1].model)
    assert (fp8.weight_dtype_bytes, fp8.kv_dtype_bytes, fp8.weight_compute) == (
        1.0, 1.0, 1.0)
    c = optimize.Config(5, 64, 2048, 1, {}, 0.0, 0.0)
    assert optimize.serving_flags(job, c) == (
        "--tensor-parallel-size 1 --max-num-seqs 64 --max-num-batched-tokens 2048 "
        "--quantization fp8 --kv-cache-dtype fp8 --gpu-memory-utilization 0.9  "
        "(x 1 replica)")
    with pytest.raises(ConfigError) as e:
        optimize.prepare(*optimize.options("optimize", [
            "hardware=h100_sxm", "model=qwen3_8b", "search.weight_dtype=[bf16,fp4]"]))
    assert str(e.value) == (
        "search.weight_dtype = ['bf16', 'fp4']: no hardware searched has fp4 tensor "
        "cores (hardware.fp4_flops_per_s = 0 on h100_sxm); allowed: bf16, fp8, "
        "int4, or hardware with them")
    with pytest.raises(ConfigError) as e:
        optimize.options("optimize", ["search.kv_dtype=[int4]"])
    assert str(e.value) == "search.kv_dtype = ['int4']: allowed: bf16, fp8"


def _model(name: str, **kw) -> Model:
    return Model(name=name, params=1e9, active_params=1e9, layers=2, q_heads=4,
                 kv_heads=2, head_dim=8, hidden_size=32, **kw)


def test_the_axis_defaults_to_the_models_own():
    a, b = _model("a"), _model("b", weight_dtype="fp8", kv_dtype="fp8")
    assert (a.weight_dtype_bytes, b.weight_dtype_bytes) == (2.0, 1.0)
    assert (a.kv_dtype_bytes, b.kv_dtype_bytes) == (2.0, 1.0)
    grid = Grid()
    assert grid.precision("weight_dtype", [a, a]) == ["bf16"]
    assert grid.precision("weight_dtype", [a, b]) == ["own"]
    assert Grid(kv_dtype=["fp8", "bf16"]).precision("kv_dtype", [a, b]) == [
        "fp8", "bf16"]


def test_own_keeps_the_model_and_bf16_is_the_bound_bitwise(hydra_ctx):
    """``OWN`` and the model's own dtype give the same step, bit for bit, and
    every quantised dtype the H100 runs (not fp4) is at least as fast as bf16."""
    from hydra import compose

    from sweep.config.convert import hardware_params, model_params
    from sweep.model import precision, roofline

    cfg = OmegaConf.to_object(compose("grid", ["hardware=h100_sxm",
                                                 "model=qwen3_8b"]))
    hw = jax.tree.map(jnp.float32, hardware_params(cfg.hardware, 1.0))
    model = jax.tree.map(jnp.float32, model_params(cfg.model))
    n, ctx = (jnp.asarray(x, jnp.float32) for x in np.meshgrid(
        [1.0, 8.0, 64.0, 256.0, 1024.0], [0.0, 1500.0, 16000.0]))

    @jit
    def steps(w, kv):
        m = precision.apply(model, jnp.int32(w), jnp.int32(kv))
        prefill = roofline.prefill_step_s(hw, m, 1.0, n * 16.0)
        return roofline.decode_step_s(hw, m, 1.0, n, ctx), prefill

    own = steps(precision.OWN, precision.OWN)
    bf16 = steps(0, 0)
    for a, b in zip(own, bf16):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for w in map(precision.WEIGHT_DTYPES.index, precision.allowed(cfg.hardware)):
        for kv in range(len(precision.KV_DTYPES)):
            for a, b in zip(steps(w, kv), bf16):
                assert (np.asarray(a) <= np.asarray(b)).all(), (w, kv)
    # fp8 weights and KV halve a memory-bound decode's bytes exactly
    decode = roofline.decode_step_s(hw, precision.apply(model, jnp.int32(1),
                                                        jnp.int32(1)), 1.0, 64.0,
                                    1500.0)
    want = (h.PARAMS + 64 * 1500 * KV_VALUES) / h.BW
    assert float(decode) == pytest.approx(want, rel=2e-6)
