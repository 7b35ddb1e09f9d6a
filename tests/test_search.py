"""The optax search against exhaustive enumeration with the same surrogate.

Every search here has the same static settings and lane shape, so the search
compiles once for the module; the enumeration compiles the plain surrogate
once.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import compose_app, jit_once

from sweep import exported
from sweep.config.convert import hardware_params, model_params
from sweep.config.schema import Routing, Search
from sweep.cube.status import OK
from sweep.latency.surrogate import latency_workload, surrogate
from sweep.latency.workload import workload_tables
from sweep.model.params import stack
from sweep.search import descent

SETTINGS = descent.Settings.of(Search(steps=60, concurrency_min=1, concurrency_max=64,
                                     token_budget_min=256, token_budget_max=4096,
                                     levels_per_octave=1, replicas_max=16))
TP = (1.0, 2.0)
RESTARTS = 4
RATE = 40.0  # req/s: several replicas, so the answer is not the lower corner
SLO = (1.0, 0.05)  # p99 TTFT, p99 ITL (s)


@pytest.fixture(scope="module")
def scenario():
    app = compose_app("optimize", ["hardware=h100_sxm", "model=qwen3_8b"])
    hw = hardware_params(app.hardware, 0.9)
    model = model_params(app.model)
    lw = latency_workload(workload_tables(app.workload))
    return hw, model, lw, app.hardware.usd_per_gpu_hour


def _candidates(scenario, rates, tps=TP):
    hw, model, lw, _ = scenario
    n = len(tps)
    f32 = jnp.float32
    return descent.Candidates(
        hw=stack([hw] * n), model=stack([model] * n),
        workload=jax.tree.map(lambda x: jnp.stack([x] * n), lw),
        tp=jnp.asarray(tps, f32), arrival_rate_per_s=jnp.asarray(rates, f32),
        ttft_target_s=jnp.full(n, SLO[0], f32), itl_target_s=jnp.full(n, SLO[1], f32),
        spec_tokens=jnp.zeros(n, f32), spec_acceptance=jnp.zeros(n, f32),
        prefix_hit_fraction=jnp.zeros(n, f32))


def test_lattice_values():
    # round(2**(k/4)) for k = 0..8, and the top value never exceeds the bound
    np.testing.assert_array_equal(descent.lattice(1, 4, 4),
                                  [1, 1, 1, 2, 2, 2, 3, 3, 4])
    np.testing.assert_array_equal(descent.lattice(256, 5000, 1),
                                  [256, 512, 1024, 2048, 4096])


def test_restarts_cover_every_stratum_of_each_axis(key):
    restarts = 4
    theta = np.asarray(descent.initial_theta(key, SETTINGS, 3, restarts), np.float64)
    lower, upper = SETTINGS.lower, SETTINGS.upper
    assert np.all(theta >= lower - 1e-5) and np.all(theta <= upper + 1e-5)
    # Latin hypercube: per candidate and axis, one restart in each quarter
    stratum = np.floor((theta - lower) / (upper - lower) * restarts).clip(0, 3)
    for c in range(3):
        for axis in range(3):
            assert sorted(stratum[c, :, axis]) == [0, 1, 2, 3]


def test_search_finds_the_enumerated_optimum(scenario, key):
    _, _, _, usd = scenario
    cands = _candidates(scenario, [RATE, RATE])
    init = descent.initial_theta(key, SETTINGS, len(TP), RESTARTS)
    res = descent.search(cands, init, SETTINGS)
    assert res.feasible.any()
    gpus = np.asarray(TP)[:, None, None] * res.replicas
    found = np.where(res.feasible, gpus, np.inf).min()

    # every (tp, concurrency, budget, replicas) of the same lattice
    conc = np.unique(SETTINGS.concurrency_values)
    budget = np.unique(SETTINGS.token_budget_values)
    points = np.array(list(itertools.product(
        range(len(TP)), conc, budget, range(1, SETTINGS.replicas_max + 1))))
    t, c, b, r = points.T
    t = t.astype(int)
    hw, model, lw, _ = scenario

    def one(tp, c, b, r):
        # round-robin (the settings' routing): each replica gets every r-th
        # request, Erlang-r gaps of squared coefficient of variation 1/r
        return surrogate(hw, model, lw, tp, c, b, RATE / r, split=r)

    out = jit_once(jax.vmap(one))(
        jnp.asarray(np.asarray(TP)[t], jnp.float32), jnp.asarray(c, jnp.float32),
        jnp.asarray(np.maximum(b, c), jnp.float32), jnp.asarray(r, jnp.float32))
    ok = ((np.asarray(out["ttft_p99_s"]) <= SLO[0])
          & (np.asarray(out["itl_p99_s"]) <= SLO[1])
          & (np.asarray(out["status"]) == OK))
    assert ok.any()
    enumerated = np.min(np.where(ok, np.asarray(TP)[t] * r, np.inf))
    assert enumerated > 1  # the scenario needs more than the cheapest corner
    # same lattice, same surrogate: the same number of GPUs, hence the same cost
    assert found == enumerated
    # cost per 1M output tokens of that answer, by hand: GPUs x price / tokens
    mean_output = float(lw.mean_output_tokens)
    cost = found * usd / (RATE * mean_output * 3600) * 1e6
    assert cost == pytest.approx(found * 4.29 / (40 * 360 * 3600) * 1e6, rel=1e-6)


def test_round_robin_replicas_wait_less_than_a_random_split(scenario):
    cands = _candidates(scenario, [RATE / 4, RATE / 12], tps=(1.0, 1.0))
    # one program for every lane: the candidate, the replicas and the routing
    # (traced here; a Python bool in the search)
    lanes = jit_once(jax.vmap(lambda cand, r, rr: descent.replica_surrogate(
        cand, 16.0, 2048.0, r, rr), in_axes=(None, 0, 0)))
    at_4 = jax.tree.map(lambda x: x[0], cands)
    out = lanes(at_4, jnp.asarray([1.0, 1.0, 3.0, 3.0], jnp.float32),
                jnp.asarray([True, False, True, False]))
    out = {m: np.asarray(v) for m, v in out.items()}
    # one replica takes the whole stream, whatever the routing
    for m in ("ttft_p99_s", "itl_p99_s"):
        assert out[m][0] == out[m][1]
    # three replicas dealt round-robin see regular gaps: their prefills queue
    # less than behind a random (Poisson) split of the same rate
    assert out["ttft_p99_s"][2] < out["ttft_p99_s"][3]
    assert out["utilization"][2] == pytest.approx(out["utilization"][3], rel=1e-6)
    # a random split is one replica's Poisson stream at a third of the rate
    # (four lanes again: the same shapes, the same compiled program)
    alone = lanes(jax.tree.map(lambda x: x[1], cands), jnp.ones(4, jnp.float32),
                  jnp.zeros(4, bool))
    assert float(alone["ttft_p99_s"][0]) == pytest.approx(out["ttft_p99_s"][3],
                                                          rel=1e-6)


def test_settings_numbers_run_the_same_compiled_search(scenario, key):
    """Steps, lattices, replicas, learning rate, barrier and routing are the
    search's ``Knobs``: another value of each runs the program compiled for
    ``SETTINGS`` (8 lanes there, 4 here: both padded to ``LANES_MIN``), and
    the answer keeps to the new settings."""
    other = descent.Settings.of(Search(
        steps=30, concurrency_min=2, concurrency_max=256, token_budget_min=512,
        token_budget_max=8192, levels_per_octave=2, replicas_max=4,
        learning_rate=0.05, penalty_weight=5.0, penalty_scale_start=0.5,
        routing=Routing.random))
    cands = _candidates(scenario, [RATE / 4, RATE / 4])
    program = exported.name(descent._run_lanes)

    def compiled() -> int:
        return sum(name.startswith(program) for name in exported._programs)

    descent.search(cands, descent.initial_theta(key, SETTINGS, len(TP), RESTARTS),
                   SETTINGS)
    before = compiled()
    assert before >= 1
    res = descent.search(cands, descent.initial_theta(key, other, len(TP), 2),
                         other)
    assert compiled() == before
    assert res.objective.shape == (len(TP), 2, 30)
    lattice = set(np.unique(other.concurrency_values))
    assert set(np.unique(res.concurrency)) <= lattice and lattice >= {2.0, 256.0}
    budgets = np.unique(res.token_budget)
    assert (budgets >= 512).all() and (budgets <= 8192).all()
    assert (res.replicas >= 1).all() and (res.replicas <= 4).all()
    assert res.feasible.any()
    # the learning rate at each step: optax's cosine decay, by hand in float64
    k = np.arange(30)
    by_hand = 0.05 * ((1 - 0.1) * 0.5 * (1 + np.cos(np.pi * k / 30)) + 0.1)
    np.testing.assert_allclose(other.knobs().learning_rate[:30], by_hand, rtol=1e-6)


def test_search_held_at_replicas_reads_its_own_answers(scenario, key):
    """``at_replicas``, as ``sweep-optimize`` probes fewer replicas: started
    at an answer of the search, with its steps set to none, the same program
    reads the surrogate's numbers the search recorded there, bit for bit;
    with its steps, every lane stays on that many replicas."""
    cands = _candidates(scenario, [RATE, RATE])
    init = descent.initial_theta(key, SETTINGS, len(TP), RESTARTS)
    res = descent.search(cands, init, SETTINGS)
    c, r, k = (int(i[0]) for i in np.nonzero(res.feasible & (res.replicas > 1)))
    at = (res.concurrency[c, r, k], res.token_budget[c, r, k], res.replicas[c, r, k])
    start = np.array(init, np.float32)
    start[c, 0] = np.log(at)
    inf = _candidates(scenario, [RATE, RATE])._replace(
        ttft_target_s=jnp.full(len(TP), jnp.inf, jnp.float32),
        itl_target_s=jnp.full(len(TP), jnp.inf, jnp.float32))
    read = descent.search(inf, start, SETTINGS, descent.at_replicas(
        SETTINGS, int(at[2]))._replace(steps=np.int32(0)))
    same = ((read.concurrency[c, 0] == at[0]) & (read.token_budget[c, 0] == at[1]))
    assert same.any() and (read.replicas[c, 0] == at[2]).all()
    n = int(np.argmax(same))
    for m in descent.METRICS:
        assert read.metrics[m][c, 0, n] == res.metrics[m][c, r, k], m
    held = descent.search(cands, init, SETTINGS, descent.at_replicas(SETTINGS, 3))
    np.testing.assert_allclose(held.theta[..., 2], np.log(3.0), rtol=1e-6)
    assert held.objective.shape == res.objective.shape
    assert (held.replicas[held.feasible] == 3).all()


def test_gradients_finite_at_zero_load_and_saturation(scenario):
    # candidate 0 idles (1e-6 req/s), candidate 1 is far past saturation
    cands = _candidates(scenario, [1e-6, 1e5])
    lo, hi = SETTINGS.lower, SETTINGS.upper
    corners = np.array([lo, hi, [lo[0], hi[1], lo[2]], [hi[0], lo[1], hi[2]]])
    init = np.broadcast_to(corners, (len(TP), RESTARTS, 3))
    res = descent.search(cands, init, SETTINGS)
    assert (res.nonfinite_steps == 0).all()
    assert np.isfinite(res.max_abs_grad).all()
    assert np.isfinite(res.objective).all()
    # idle: one replica meets the SLO; saturated: nothing does
    assert res.feasible[0].all() and (res.replicas[0] == 1).all()
    assert not res.feasible[1].any()
    assert np.isfinite(res.reach["ttft_p99_s"][1]).all()


def test_settings_are_the_search_config_frozen():
    config = Search(steps=60, tensor_parallel=[1, 2], optimizer_options={"b2": 0.8})
    s = descent.Settings.of(config)
    # read as the config reads, with the config's defaults for the rest
    assert (s.steps, s.learning_rate, s.replicas_max) == (60, 0.1, 256)
    assert s.optimizer_options == (("b2", 0.8),)
    assert s.tensor_parallel == (1, 2)
    # a hashable value: equal configs are equal settings (one compiled search)
    again = descent.Settings.of(Search(steps=60, tensor_parallel=[1, 2],
                                      optimizer_options={"b2": 0.8}))
    assert again == s and hash(again) == hash(s)
    assert descent.Settings.of(Search(steps=61, tensor_parallel=[1, 2],
                                     optimizer_options={"b2": 0.8})) != s
    # a later change to the config does not reach the settings
    config.steps = 7
    assert s.steps == 60
    with pytest.raises(AttributeError, match="no field 'step'"):
        s.step  # noqa: B018
