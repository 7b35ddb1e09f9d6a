"""Speculative decoding with a draft model (``grid.spec_proposer=[draft]``)
or an EAGLE-3 head (``[eagle3]``: a one-layer draft of its own).

Hand calculations of the draft's steps, its pass over prompt chunks (a
prefill alone, a chunk beside decodes, a long prompt's chunks in closed
form) and its memory in float64, the exactness
of the n-gram and no-speculation paths, the law that a draft model only adds
cost, where it pays and where it hurts on the shipped H100 x Llama-3.1-8B,
the simulator against the step-by-step reference on a hard stream, the
surrogate at zero load, and the refusals of bad input.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers import (
    BW,
    FLOPS,
    NVLINK,
    assert_matches_reference,
    grid_inputs,
    h100,
    jit_once,
    run_script,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_scheduler import simulate_reference

import sweep
from sweep.config.convert import hardware_params, model_params
from sweep.errors import ConfigError
from sweep.exported import jit
from sweep.latency.arrivals import Requests
from sweep.latency.simulate import simulate_requests
from sweep.latency.surrogate import latency_workload, surrogate
from sweep.latency.workload import WorkloadTables
from sweep.model import roofline
from sweep.model.batching import CONTINUOUS
from sweep.model.params import ModelParams

# Llama-3.1-8B and its draft Llama-3.2-1B (conf/model), bf16
W_T = 8.03e9 * 2  # target weight bytes
Q_T = 2 * 32 * 8 * 128 * 2  # target KV bytes per token: 131,072
W_D = 1.24e9 * 2  # draft weight bytes
Q_D = 2 * 16 * 8 * 64 * 2  # draft KV bytes per token: 32,768
F_T = 4 * 32 * 32 * 128  # target attention FLOPs per key
F_D = 4 * 16 * 32 * 64  # draft attention FLOPs per key
DRAFT = dict(draft_params=1.24e9, draft_layers=16.0, draft_q_heads=32.0,
             draft_kv_heads=8.0, draft_head_dim=64.0, draft_hidden_size=2048.0,
             draft_weight_dtype_bytes=2.0)
# Llama-3.1-8B's EAGLE-3 head (H 4096, 32 query and 8 KV heads of 128, MLP
# 14,336): q, k, v projections from 2H inputs, the output projection, the
# gated MLP, the fc of 3H x H, an LM head over 32,000 draft tokens
N_E = (2 * 4096 * 4096 + 2 * 8192 * 1024 + 4096 * 4096 + 3 * 4096 * 14336
       + 3 * 4096 * 4096 + 32000 * 4096)  # 424,673,280
W_E = N_E * 2  # bf16
Q_E = 2 * 1 * 8 * 128 * 2  # one layer's KV per token: 4,096 bytes
EAGLE3 = dict(DRAFT, draft_params=float(N_E), draft_layers=1.0, draft_q_heads=32.0,
              draft_kv_heads=8.0, draft_head_dim=128.0, draft_hidden_size=4096.0)


def llama(dtype=np.float64, draft=True, leaves=DRAFT):
    return ModelParams(*(dtype(x) for x in (
        8.03e9, 0.0, 8.03e9, 32, 32, 8, 128, 4096, 1.0, 2, 2)),
        **({k: dtype(v) for k, v in leaves.items()} if draft else {}))


def _f(x) -> float:
    return float(np.asarray(x))


def test_draft_steps_by_hand():
    """k = 4 draft steps at batch 1, context 1,000 (memory-bound: weights and
    the draft's KV), then at batch 1,024, context 10 per sequence on two GPUs
    (compute-bound, with the draft's all-reduces); the verification step is
    the n-gram one plus them."""
    with jax.enable_x64(True):
        hw, m = h100(), llama()
        got = _f(roofline.draft_s(hw, m, 1.0, 1.0, 1000.0, 4.0))
        want = 4 * (W_D + 1000 * Q_D) / BW  # 4 x 0.750080 ms
        np.testing.assert_allclose(got, want, rtol=1e-12)
        np.testing.assert_allclose(want, 3.000319e-3, rtol=1e-6)

        got = _f(roofline.draft_s(hw, m, 2.0, 1024.0, 10240.0, 4.0))
        compute = (2 * 1.24e9 * 1024 + F_D * 10240) / 2 / FLOPS
        memory = (W_D + 10240 * Q_D) / 2 / BW
        assert compute > memory
        allreduce = 2 * 16 * (2 * 1 / 2 * 1024 * 2048 * 2) / NVLINK
        np.testing.assert_allclose(got, 4 * (compute + allreduce), rtol=1e-12)

        verify = _f(roofline.speculative_step_s(hw, m, 1.0, 1.0, 1000.0, 4.0))
        target = max((W_T + 1000 * Q_T) / BW,
                     (2 * 8.03e9 * 5 + F_T * (5 * 1000 + 10)) / FLOPS)
        np.testing.assert_allclose(verify, target + 4 * (W_D + 1000 * Q_D) / BW,
                                   rtol=1e-12)
        np.testing.assert_allclose(verify, 7.833476e-3, rtol=1e-6)


def test_draft_prefill_by_hand():
    """The draft prefills each chunk with the target: a 1,500-token prompt
    in one step at k = 4 (both models compute-bound), the last 1,536 tokens
    of a 2,048-token prompt after a 512-token cached prefix on two GPUs (the
    draft's all-reduces), and the same prompt at k = 0, where no draft
    runs."""
    with jax.enable_x64(True):
        hw, m = h100(), llama()
        got = _f(roofline.prefill_step_s(hw, m, 1.0, 1500.0, 0.0, 4.0))
        target = (2 * 8.03e9 * 1500 + F_T * 1500 * 1501 / 2) / FLOPS
        draft = (2 * 1.24e9 * 1500 + F_D * 1500 * 1501 / 2) / FLOPS
        assert draft > W_D / BW and target > W_T / BW
        np.testing.assert_allclose(got, target + draft, rtol=1e-12)
        np.testing.assert_allclose(got, 24.95472e-3 + 3.91057e-3, rtol=1e-6)

        got = _f(roofline.prefill_step_s(hw, m, 2.0, 2048.0, 512.0, 4.0))
        keys = 1536 * 512 + 1536 * 1537 / 2
        target = max((W_T + 512 * Q_T) / 2 / BW,
                     (2 * 8.03e9 * 1536 + F_T * keys) / 2 / FLOPS)
        draft = max((W_D + 512 * Q_D) / 2 / BW,
                    (2 * 1.24e9 * 1536 + F_D * keys) / 2 / FLOPS)

        def allreduce(layers, hidden):
            return 2 * layers * (2 * 1 / 2 * 1536 * hidden * 2) / NVLINK

        np.testing.assert_allclose(
            got, target + allreduce(32, 4096) + draft + allreduce(16, 2048),
            rtol=1e-12)

        got = _f(roofline.prefill_step_s(hw, m, 2.0, 2048.0, 512.0, 0.0))
        np.testing.assert_allclose(got, target + allreduce(32, 4096), rtol=1e-12)


def test_draft_mixed_step_by_hand():
    """Eight decodes at context 1,000 each verifying k = 4 proposals beside
    a 512-token chunk after 1,024 prefilled tokens: the draft's first pass
    takes the 8 decodes and the 512 chunk tokens together (its weights read
    once, compute-bound: 1.39 ms against 0.83 ms of reads), its other three
    only the decodes (memory-bound)."""
    with jax.enable_x64(True):
        hw, m = h100(), llama()
        got = _f(roofline.mixed_step_s(hw, m, 1.0, 8.0, 8000.0, 512.0, 1024.0, 4.0))
        chunk_keys = 512 * 1024 + 512 * 513 / 2
        target = max((W_T + 9024 * Q_T) / BW,
                     (2 * 8.03e9 * (8 * 5 + 512)
                      + F_T * (5 * 8000 + 8 * 10 + chunk_keys)) / FLOPS)
        first_memory = (W_D + 9024 * Q_D) / BW
        first = (2 * 1.24e9 * 520 + F_D * (8000 + chunk_keys)) / FLOPS
        assert first > first_memory
        rest = (W_D + 8000 * Q_D) / BW
        assert rest > (2 * 1.24e9 * 8 + F_D * 8000) / FLOPS
        np.testing.assert_allclose(got, target + first + 3 * rest, rtol=1e-12)
        np.testing.assert_allclose(first, 1.391892e-3, rtol=1e-6)
        np.testing.assert_allclose(first_memory, 0.828567e-3, rtol=1e-6)
        # without a chunk: the k equal passes over the decodes
        got = _f(roofline.mixed_step_s(hw, m, 1.0, 8.0, 8000.0, 0.0, 0.0, 4.0))
        np.testing.assert_allclose(
            got, _f(roofline.speculative_step_s(hw, m, 1.0, 8.0, 1000.0, 4.0)),
            rtol=1e-12)


@pytest.mark.parametrize("n, c, prompt, budget, k, cached", [
    (64, 1500, 8192, 512, 4.0, 0.0), (8, 1000, 30_000, 2048, 3.0, 4096.0),
    (0, 0, 20_000, 1536, 4.0, 0.0), (256, 512, 5000, 4096, 2.0, 1024.0),
    # the draft's first pass turns from memory- to compute-bound at ~60k
    (32, 4000, 100_000, 64, 4.0, 0.0),
])
def test_draft_chunked_prefill_matches_chunk_loop(n, c, prompt, budget, k, cached):
    """``chunked_prefill`` with the draft's pass over each chunk (closed form,
    its own crossing) against the sum of its chunks' ``mixed_step_s``."""
    with jax.enable_x64(True):
        hw, m = h100(mfu=0.3), llama()
        total, steps, worst = (_f(x) for x in roofline.chunked_prefill(
            hw, m, 1.0, float(n), float(c), float(prompt), float(budget), k, cached))
        b = budget
        times, done = [], cached
        while done < prompt:
            chunk = min(b, prompt - done)
            times.append(_f(roofline.mixed_step_s(hw, m, 1.0, float(n), float(n * c),
                                                  chunk, done, k)))
            done += chunk
        assert steps == len(times)
        np.testing.assert_allclose(total, sum(times), rtol=1e-12)
        np.testing.assert_allclose(worst, max(times), rtol=1e-12)


def test_kv_capacity_by_hand():
    """Both models' weights leave the memory and every token holds both KVs."""
    with jax.enable_x64(True):
        got = _f(roofline.kv_capacity_tokens(h100(), llama(), 1.0))
        np.testing.assert_allclose(got, (80e9 - W_T - W_D) / (Q_T + Q_D),
                                   rtol=1e-12)
        np.testing.assert_allclose(got, 375122.07, rtol=1e-7)


def test_ngram_and_no_speculation_are_unchanged():
    """The n-gram proposer and k = 0 load no draft: every figure is bitwise
    the draft-less model's (float32, as users run)."""
    f32 = np.float32
    hw, plain = h100(f32), llama(f32, draft=False)
    for proposer, k in ((roofline.NGRAM, 4.0), (roofline.DRAFT, 0.0)):
        m = roofline.with_proposer(llama(f32), f32(proposer), f32(k))
        for fn, args in (
                (roofline.verify_step_s, (f32(64), f32(1500), f32(k))),
                (roofline.mixed_step_s,
                 (f32(64), f32(96000), f32(512), f32(0), f32(k))),
                (roofline.kv_capacity_tokens, ())):
            assert _f(fn(hw, m, f32(1), *args)) == _f(fn(hw, plain, f32(1), *args))
        got = roofline.chunked_prefill(hw, m, f32(1), f32(64), f32(1500), f32(8192),
                                       f32(512), f32(k))
        want = roofline.chunked_prefill(hw, plain, f32(1), f32(64), f32(1500),
                                        f32(8192), f32(512), f32(k))
        assert [_f(x) for x in got] == [_f(x) for x in want]


@settings(max_examples=60, deadline=None)
@given(batch=st.integers(1, 1024), context=st.floats(16.0, 32768.0),
       k=st.integers(1, 8), acceptance=st.floats(0.0, 1.0),
       tp=st.sampled_from([1.0, 2.0, 4.0]))
def test_draft_never_beats_ngram(batch, context, k, acceptance, tp):
    """At the same k and acceptance the draft proposer only adds time (its
    steps) and memory (its weights and KV): per accepted token it is never
    faster than n-gram, and never fits more sequences."""
    with jax.enable_x64(True):
        hw = h100()
        ngram = roofline.with_proposer(llama(), roofline.NGRAM, float(k))
        draft = roofline.with_proposer(llama(), roofline.DRAFT, float(k))
        gain = roofline.tokens_per_step(float(k), acceptance)
        tpot = [_f(roofline.verify_step_s(hw, m, tp, float(batch), context, float(k))
                   / gain) for m in (ngram, draft)]
        assert tpot[1] > tpot[0]
        fit = [_f(roofline.max_concurrency_fit(hw, m, tp, context + k))
               for m in (ngram, draft)]
        assert fit[1] <= fit[0]
        # nor does the draft's pass over a prompt chunk make any step faster
        chunk, cached = float(1 + batch * 31 % 4096), float(batch * 97 % 20_000)
        for args in ((0.0, 0.0), (float(batch), batch * context)):
            mixed = [_f(roofline.mixed_step_s(hw, m, tp, *args, chunk, cached,
                                              float(k))) for m in (ngram, draft)]
            assert mixed[1] > mixed[0]
        long = [_f(roofline.chunked_prefill(hw, m, tp, float(batch), context,
                                            cached + 8 * chunk, 4096.0 + chunk,
                                            float(k), cached)[0])
                for m in (ngram, draft)]
        assert long[1] > long[0]


@pytest.fixture(scope="module")
def seed_llama():
    """The shipped H100 SXM and Llama-3.1-8B with its draft (seed experiment,
    real Hydra composition)."""
    base, options = grid_inputs([
        "experiment=seed", "hardware=h100_sxm", "model=llama3_1_8b",
        "grid.hardware=[h100_sxm]", "grid.model=[llama3_1_8b]",
        "grid.spec_tokens=[0,4]", "grid.spec_proposer=[ngram,draft]"])
    (hw,), (m,) = options["hardware"], options["model"]
    assert m.draft.name == "llama3_2_1b" and m.draft.hf_id.startswith("meta-llama/")
    return hardware_params(hw, base.grid.gpu_memory_utilization), model_params(m)


def test_draft_pays_at_batch_one_and_hurts_at_large_batch(seed_llama):
    """Acceptance 0.7, k = 4 (2.77 tokens per step): at batch 1, context
    1,500, the target is memory-bound and the draft's four steps (a 1.24B
    model's weights, 15 % of the target's) cost less than the 1.77 extra
    tokens they win. At batch 256, context 512, the verification step is
    compute-bound (5 x 256 tokens, 21 ms against a 9.9 ms decode): n-gram
    still gains a little, the draft's four steps on top make it slower per
    token than no speculation at all."""
    hw, m = seed_llama
    gain = _f(roofline.tokens_per_step(4.0, 0.7))
    for batch, context, pays in ((1.0, 1500.0, True), (256.0, 512.0, False)):
        plain = _f(roofline.decode_step_s(hw, m, 1.0, batch, context))
        tpot = [_f(roofline.verify_step_s(
            hw, roofline.with_proposer(m, proposer, 4.0), 1.0, batch, context, 4.0))
            / gain for proposer in (roofline.NGRAM, roofline.DRAFT)]
        assert tpot[0] < plain, (batch, tpot, plain)
        assert (tpot[1] < plain) == pays, (batch, tpot, plain)


# a hard stream: two bursts of simultaneous arrivals, 20k-token prompts
# among short ones, long and one-token outputs
ARRIVAL = np.concatenate([np.zeros(8), np.full(8, 0.5), 0.6 + np.arange(8) * 0.05])
PROMPT = np.array([20000, 30, 700, 1500, 200, 20000, 64, 3000] * 3, float)
OUTPUT = np.array([1, 300, 40, 120, 5, 200, 250, 17] * 3, float)


# eight 2,000-token prompts at once and 400-token outputs, the rest much
# later: at 2.45 % of the FLOP/s the draft's steps over the eight decodes are
# compute-bound until their summed context passes ~17,500 tokens, which it
# does halfway through one long run of unchanged steps
CROSSING = (np.concatenate([np.zeros(8), 100.0 + np.arange(16)]),
            np.array([2000.0] * 8 + [50.0] * 16), np.array([400.0] * 8 + [3.0] * 16))

# four decoding requests, then a 60,000-token prompt prefilled beside them in
# 240-token chunks: the draft's pass over a chunk and the four decodes (244
# tokens) is memory-bound at first and compute-bound from about the 30th
# chunk on, within one run of unchanged steps
LONG = (np.array([0.0, 0.0, 0.0, 0.0, 0.05]), np.array([1000.0] * 4 + [60000.0]),
        np.array([2000.0] * 4 + [5.0]))


@pytest.fixture(scope="module")
def sim_draft64():
    @jit
    def run(hw, model, conc, budget, k, a, arrival, prompt, output):
        return simulate_requests(hw, model, 1.0, conc, budget,
                                 Requests(arrival, prompt, output), CONTINUOUS,
                                 np.inf, np.inf, 0, None, k, a, 0.0, max_slots=8)

    def call(hw, model, conc, budget, k, a, stream):
        with jax.enable_x64(True):
            return jax.tree.map(np.asarray, run(
                hw, model, *(np.float64(x) for x in (conc, budget, k, a)), *stream))
    return call


@pytest.mark.parametrize("memory,mfu,conc,budget,k,a,stream", [
    # plenty of memory, the peaks: the draft is memory-bound throughout
    (80e9, 1.0, 8, 512, 4, 0.7, "hard"),
    # 2 % of the FLOP/s: the draft's steps are compute-bound or memory-bound
    # by the step's decodes and context
    (80e9, 0.02, 8, 2048, 3, 0.5, "hard"),
    # KV for 43k tokens of both models: preemptions
    (W_T + W_D + (Q_T + Q_D) * 43000, 1.0, 8, 1024, 4, 0.8, "hard"),
    # the draft's steps turn memory-bound within a run (the run ends there)
    (80e9, 0.0245, 8, 2048, 3, 0.5, "crossing"),
    # the draft's first pass, over a long prompt's chunks, turns compute-bound
    (80e9, 1.0, 8, 256, 3, 0.5, "long"),
])
def test_simulator_matches_reference_with_draft(sim_draft64, memory, mfu, conc,
                                                budget, k, a, stream):
    stream = {"hard": (ARRIVAL, PROMPT, OUTPUT), "crossing": CROSSING,
              "long": LONG}[stream]
    with jax.enable_x64(True):
        hw, m = h100(memory_bytes=memory, mfu=mfu), llama()
        got = sim_draft64(hw, m, conc, budget, k, a, stream)
    ref = simulate_reference(hw, m, 1.0, conc, budget, *stream, CONTINUOUS,
                             spec_tokens=k, spec_acceptance=a)
    assert got.status == 0
    assert (got.steps, got.preemptions) == (ref.steps, ref.preemptions)
    if memory < 80e9:
        assert ref.preemptions > 0
    np.testing.assert_allclose(got.ttft_s, ref.ttft_s, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(got.e2e_s, ref.e2e_s, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(got.duration_s, ref.duration_s, rtol=1e-12)
    # the draft's time is in there: the n-gram run of the same stream is faster
    no_draft = simulate_reference(hw, llama(draft=False), 1.0, conc, budget,
                                  *stream, CONTINUOUS, spec_tokens=k,
                                  spec_acceptance=a)
    assert ref.duration_s > no_draft.duration_s


def test_surrogate_zero_load_itl_by_hand():
    """One sequence at a time (no traffic), 1,500-token prompts, 200-token
    outputs: the ITL is one verification step at the mean context of the
    decodes (~1,600 tokens), the draft's four steps included, in float32."""
    f32 = np.float32
    wl = latency_workload(WorkloadTables(
        "fixed", np.array([1500.0]), np.array([1.0]), np.array([200.0]),
        np.array([1.0])))
    fn = jit_once(surrogate, compiler_options={"xla_backend_optimization_level": 0})
    out = fn(h100(f32), llama(f32), wl, f32(1), f32(64), f32(2048), f32(1e-6),
             f32(np.inf), f32(np.inf), f32(4), f32(0.5))
    verify = max((W_T + 1600 * Q_T) / BW,
                 (2 * 8.03e9 * 5 + F_T * (5 * 1600 + 10)) / FLOPS)
    want = verify + 4 * (W_D + 1600 * Q_D) / BW
    np.testing.assert_allclose(_f(out["itl_p50_s"]), want, rtol=1e-2)


@pytest.mark.parametrize("args, message", [
    (["model=llama3_1_8b", "model.draft_model=nope", "grid.spec_tokens=[4]",
      "grid.spec_proposer=[draft]"],
     "model[llama3_1_8b].draft_model = 'nope': unknown option; allowed: "),
    (["model=mistral_7b", "grid.spec_tokens=[4]", "grid.spec_proposer=[ngram,draft]"],
     "grid.spec_proposer lists draft: model[mistral_7b].draft_model is empty"),
    (["model=llama3_1_8b", "grid.spec_tokens=[0]", "grid.spec_proposer=[draft]"],
     "grid.spec_tokens = [0]: grid.spec_proposer lists draft: needs some k > 0"),
    (["model=llama3_1_8b", "grid.spec_tokens=[4]", "grid.spec_proposer=[eagle]"],
     "grid.spec_proposer = ['eagle']: allowed: distinct values of ngram, draft, "
     "eagle3"),
    (["model=mistral_7b", "grid.spec_tokens=[4]", "grid.spec_proposer=[ngram,eagle3]"],
     "grid.spec_proposer lists eagle3: model[mistral_7b].eagle3_head is empty"),
    (["model=mixtral_8x7b", "model.eagle3_head=some/head", "grid.spec_tokens=[4]",
      "grid.spec_proposer=[eagle3]"],
     "grid.spec_proposer lists eagle3: model[mixtral_8x7b] has 8 experts and "
     "eagle3_intermediate_size is 0 (a MoE model's head has a dense MLP of its own: "
     "set model.eagle3_intermediate_size=<the head's config.json "
     "intermediate_size>); allowed for mixtral_8x7b: ngram"),
    (["model=llama3_1_8b", "model.intermediate_size=0", "grid.spec_tokens=[4]",
      "grid.spec_proposer=[eagle3]"],
     "grid.spec_proposer lists eagle3: model[llama3_1_8b].intermediate_size is 0"),
    (["model=llama3_1_8b", "grid.spec_tokens=[4]", "grid.spec_proposer=[draft,eagle3]"],
     "grid.spec_proposer = ['draft', 'eagle3']: draft and eagle3 load different "
     "models: list one of them per grid"),
    (["model=llama3_1_8b", "grid.spec_tokens=[0]", "grid.spec_proposer=[eagle3]"],
     "grid.spec_tokens = [0]: grid.spec_proposer lists eagle3: needs some k > 0"),
    (["model=llama3_1_8b", "model.draft_model=llama3_1_70b", "grid.spec_tokens=[4]",
      "grid.spec_proposer=[draft]"],
     "model[llama3_1_8b].draft_model = 'llama3_1_70b': must be a dense model "
     "smaller than llama3_1_8b"),
])
def test_bad_draft_input_is_one_line(args, message):
    with pytest.raises(ConfigError) as e:
        grid_inputs(["grid.hardware=[h100_sxm]", *args])
    text = str(e.value)
    assert text.startswith(message) and "\n" not in text, text


def test_grid_compares_proposers_in_float32(tmp_path):
    """``sweep-grid`` on a tiny grid with both proposers, float32: a draft
    point is slower per token and dearer than its n-gram twin, k = 0 is the
    same for both, and the proposer axis carries its units."""
    proc = run_script("sweep-grid", [
        "experiment=seed", "hardware=h100_sxm", "model=llama3_1_8b",
        "grid.hardware=[h100_sxm]", "grid.model=[llama3_1_8b]",
        "grid.tensor_parallel=[1]", "grid.concurrency=[1,256]",
        "grid.token_budget=[2048]", "grid.context_tokens=[512]",
        "grid.batching=[continuous]", "grid.traffic_tokens_per_day=[1e9]",
        "grid.spec_tokens=[0,4]", "grid.spec_acceptance=[0.7]",
        "grid.spec_proposer=[ngram,draft]", "out=cube.zarr"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    ds = sweep.open_cube(tmp_path / "cube.zarr")
    assert ds.spec_proposer.values.tolist() == [0, 1]
    assert ds.spec_proposer.attrs["units"] == "1"
    v = ds[["tpot_s", "cost_per_mtok_out_usd", "max_concurrency_fit"]].squeeze(
        drop=True)
    assert v.tpot_s.dtype == np.float32
    off = v.sel(spec_tokens=0)
    assert (off.sel(spec_proposer=0) == off.sel(spec_proposer=1)).all()
    on = v.sel(spec_tokens=4)
    for var in ("tpot_s", "cost_per_mtok_out_usd"):
        assert (on[var].sel(spec_proposer=1) > on[var].sel(spec_proposer=0)).all()
    assert (on.max_concurrency_fit.sel(spec_proposer=1)
            < on.max_concurrency_fit.sel(spec_proposer=0)).all()
    # at batch 1 the draft beats no speculation; at 256 (context 512) it loses
    tpot = v.tpot_s
    assert tpot.sel(concurrency=1, spec_tokens=4, spec_proposer=1) < tpot.sel(
        concurrency=1, spec_tokens=0, spec_proposer=0)
    assert tpot.sel(concurrency=256, spec_tokens=4, spec_proposer=1) > tpot.sel(
        concurrency=256, spec_tokens=0, spec_proposer=0)


def test_optimize_candidates_per_proposer():
    """``search.spec_proposer=[ngram,draft,eagle3]``: k = 0 once, each k > 0
    with each proposer at its own acceptance; the draft candidate carries
    Llama-3.2-1B, the EAGLE-3 one its head (KV room: draft < head < none)
    and every engine's flags name them; a draft proposer with every k = 0,
    and acceptances not one per proposer, are refused."""
    from helpers import optimize_inputs

    from sweep.search import optimize

    args = ["hardware=h100_sxm", "model=llama3_1_8b", "workload=seed_chat",
            "calibration=roofline", "search=quick", "search.tensor_parallel=[1]",
            "search.spec_tokens=[0,4]", "search.spec_proposer=[ngram,draft,eagle3]"]
    job = optimize.prepare(*optimize_inputs(
        [*args, "search.spec_acceptance=[0.5,0.6,0.8]"]))
    got = [(c.spec_tokens, c.spec_proposer, c.spec_acceptance) for c in job.candidates]
    assert got == [(0, "ngram", 0.5), (4, "ngram", 0.5), (4, "draft", 0.6),
                   (4, "eagle3", 0.8)]
    rows, _ = optimize.simulation_inputs(job, job.candidates, [8] * 4, [2048] * 4)
    np.testing.assert_allclose(rows.spec_acceptance, [0.5, 0.5, 0.6, 0.8], rtol=1e-7)
    drafts = [c.model.draft for c in job.candidates]
    assert drafts[:2] == [None, None] and drafts[2].name == "llama3_2_1b"
    assert drafts[3].params == N_E
    assert job.candidates[2].label.endswith("x spec k=4 (draft llama3_2_1b)")
    assert job.candidates[3].label.endswith("x spec k=4 (EAGLE-3 head)")
    hw = hardware_params(job.candidates[0].hardware, 0.9)
    caps = [_f(roofline.kv_capacity_tokens(hw, model_params(c.model), 1.0))
            for c in job.candidates]
    assert caps[2] < caps[3] < caps[1] == caps[0]
    for i, method, algorithm, kind, hf in (
            (2, "draft_model", "STANDALONE", "DraftTarget",
             "meta-llama/Llama-3.2-1B-Instruct"),
            (3, "eagle3", "EAGLE3", "Eagle3", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B")):
        config = optimize.Config(candidate=i, concurrency=64, token_budget=2048,
                                 replicas=1, surrogate={}, cost_per_mtok_out_usd=0.1,
                                 cost_per_month_usd=1.0)
        assert (f'--speculative-config \'{{"method": "{method}", "model": '
                f'"{hf}", "num_speculative_tokens": 4}}\''
                in optimize.serving_flags(job, config, "vllm"))
        assert (f"--speculative-algorithm {algorithm} --speculative-draft-model-path "
                f"{hf} --speculative-num-steps 4"
                in optimize.serving_flags(job, config, "sglang"))
        assert (f"decoding_type: {kind}, max_draft_len: 4"
                in optimize.serving_notes(job, config, "trtllm")[0])
    with pytest.raises(ConfigError, match=r"^search\.spec_tokens = \[0\]: "
                       r"search\.spec_proposer lists draft: needs some k > 0"):
        optimize_inputs([*args[:-2], "search.spec_tokens=[0]",
                         "search.spec_proposer=[draft]"])
    with pytest.raises(ConfigError) as e:
        optimize_inputs([*args, "search.spec_acceptance=[0.5,0.6]"])
    assert str(e.value) == ("search.spec_acceptance = [0.5, 0.6]: one number in "
                            "[0, 1], or one per search.spec_proposer (3)")


# --- EAGLE-3 heads (grid.spec_proposer=[eagle3]) -------------------------------

EAGLE3_GRID = ["experiment=seed", "hardware=h100_sxm", "model=llama3_1_8b",
               "grid.hardware=[h100_sxm]", "grid.model=[llama3_1_8b]",
               "grid.tensor_parallel=[1]", "grid.concurrency=[1,256]",
               "grid.token_budget=[2048]", "grid.context_tokens=[512]",
               "grid.batching=[continuous]", "grid.traffic_tokens_per_day=[1e9]",
               "grid.spec_tokens=[0,3]", "grid.spec_acceptance=[0.7]",
               "grid.spec_proposer=[ngram,eagle3]"]


def test_eagle3_head_by_hand():
    """Llama-3.1-8B's head from the shipped config: 424,673,280 parameters
    (summed above, term by term), one layer, bf16, the target's heads; its
    three passes at batch 1 and context 1,000 read its weights and its one
    layer's KV; the KV room loses its weights and every token holds its KV."""
    assert N_E == 424_673_280
    assert roofline.eagle3_head_params(4096, 14336, 32, 8, 128) == N_E
    _, options = grid_inputs(EAGLE3_GRID[1:])
    (m,) = options["model"]
    head = m.draft
    assert head is m.eagle3 and head.hf_id == "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"
    assert (head.params, head.active_params, head.layers) == (N_E, N_E, 1)
    assert (head.q_heads, head.kv_heads, head.head_dim, head.hidden_size,
            head.weight_dtype) == (32, 8, 128, 4096, "bf16")
    leaves = model_params(m)
    for k, v in EAGLE3.items():
        assert float(getattr(leaves, k)) == v, k
    with jax.enable_x64(True):
        hw, e = h100(), llama(leaves=EAGLE3)
        got = _f(roofline.draft_s(hw, e, 1.0, 1.0, 1000.0, 3.0))
        want = 3 * (W_E + 1000 * Q_E) / BW  # 3 x 0.254759 ms
        np.testing.assert_allclose(got, want, rtol=1e-12)
        np.testing.assert_allclose(want, 7.642769e-4, rtol=1e-6)
        cap = _f(roofline.kv_capacity_tokens(hw, e, 1.0))
        np.testing.assert_allclose(cap, (80e9 - W_T - W_E) / (Q_T + Q_E),
                                   rtol=1e-12)


def test_eagle3_head_of_a_moe_model_by_hand():
    """A MoE model's head: the target's attention (Qwen3-30B-A3B: H 2,048,
    32 x 128 query, 4 x 128 KV) and a dense MLP of the width given
    (``model.eagle3_intermediate_size``, the head's own config), not the
    experts' 768: 2 H q + 2 (2 H) kv + q H + 3 H I + 3 H^2 + 32,000 H =
    16,777,216 + 4,194,304 + 8,388,608 + 37,748,736 + 12,582,912 +
    65,536,000 = 145,227,776 parameters at I = 6,144; the shipped head's
    I = 12,288 gives 75,497,472 for the MLP, 182,976,512 in all."""
    _, options = grid_inputs([
        *EAGLE3_GRID[1:], "model=qwen3_30b_a3b", "grid.model=[qwen3_30b_a3b]",
        "model.eagle3_head=some/qwen3-30b-a3b-eagle3",
        "model.eagle3_intermediate_size=6144"])
    (m,) = options["model"]
    head = m.draft
    assert head is m.eagle3 and head.hf_id == "some/qwen3-30b-a3b-eagle3"
    assert (head.params, head.layers, head.intermediate_size, head.num_experts) == (
        145_227_776, 1, 6144, 1)
    assert (head.q_heads, head.kv_heads, head.head_dim, head.hidden_size) == (
        32, 4, 128, 2048)
    # the shipped head: a width of 12,288, 75,497,472 in its MLP
    _, options = grid_inputs([*EAGLE3_GRID[1:], "model=qwen3_30b_a3b",
                              "grid.model=[qwen3_30b_a3b]"])
    (m,) = options["model"]
    assert m.draft.hf_id == "Tengyunw/qwen3_30b_moe_eagle3"
    assert (m.draft.params, m.draft.intermediate_size) == (182_976_512, 12288)
    # a dense model's head keeps its own MLP unless the width is given
    _, options = grid_inputs([*EAGLE3_GRID[1:], "model.eagle3_intermediate_size=7168"])
    assert options["model"][0].draft.params == N_E - 3 * 4096 * (14336 - 7168)


def test_simulator_matches_reference_with_eagle3(sim_draft64):
    """The head's passes through the simulator and the step-by-step reference
    on the hard stream, with preemptions (KV for 43k tokens of both)."""
    stream = (ARRIVAL, PROMPT, OUTPUT)
    with jax.enable_x64(True):
        hw = h100(memory_bytes=W_T + W_E + (Q_T + Q_E) * 43000)
        m = llama(leaves=EAGLE3)
        got = sim_draft64(hw, m, 8, 1024, 3, 0.7, stream)
    ref = simulate_reference(hw, m, 1.0, 8, 1024, *stream, CONTINUOUS,
                             spec_tokens=3, spec_acceptance=0.7)
    assert ref.preemptions > 0
    assert_matches_reference(got, ref, np.inf, np.inf, 1024)


def test_grid_compares_ngram_and_eagle3_in_float32(tmp_path):
    """``sweep-grid`` with n-gram and EAGLE-3 proposals, float32: at batch 1
    a step with k = 3 takes the n-gram step plus the head's three passes
    (by hand); EAGLE-3 costs more than n-gram and leaves less KV room, and
    beats no speculation by less at batch 256 than at batch 1 (at context
    512 it still pays there: a head's pass is a twentieth of the target's
    weights); k = 0 is the same for both; the axis holds 0 and 2."""
    proc = run_script("sweep-grid", [*EAGLE3_GRID, "out=cube.zarr"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    ds = sweep.open_cube(tmp_path / "cube.zarr")
    assert ds.spec_proposer.values.tolist() == [0, 2]
    v = ds[["step_s", "tpot_s", "cost_per_mtok_out_usd", "max_concurrency_fit"]
           ].squeeze(drop=True)
    off = v.sel(spec_tokens=0)
    assert (off.sel(spec_proposer=0) == off.sel(spec_proposer=2)).all()
    on = v.sel(spec_tokens=3)
    passes = float(on.step_s.sel(concurrency=1, spec_proposer=2)
                   - on.step_s.sel(concurrency=1, spec_proposer=0))
    np.testing.assert_allclose(passes, 3 * (W_E + 512 * Q_E) / BW, rtol=1e-4)
    for var in ("tpot_s", "cost_per_mtok_out_usd"):
        assert (on[var].sel(spec_proposer=2) > on[var].sel(spec_proposer=0)).all()
    assert (on.max_concurrency_fit.sel(spec_proposer=2)
            < on.max_concurrency_fit.sel(spec_proposer=0)).all()
    # the head's gain per token shrinks as the verify step turns compute-bound
    gain = (v.tpot_s.sel(spec_tokens=3, spec_proposer=2)
            / v.tpot_s.sel(spec_tokens=0, spec_proposer=0))
    assert float(gain.sel(concurrency=1)) < float(gain.sel(concurrency=256)) < 1.0
    # the cube does not hold the head's id: the flags leave speculation to a note
    point = ds.sweep.to_serving_flags(concurrency=1, spec_tokens=3, spec_proposer=2)
    assert "--speculative-config" not in point.cli
    assert ("EAGLE-3 speculation, 3 tokens per step: the flags need the EAGLE-3 "
            "head's Hugging Face id (the model config's eagle3_head)") in point.notes[0]
