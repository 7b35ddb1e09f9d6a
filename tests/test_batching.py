"""Batching policies (``sweep.model.batching``): the registry, each policy's answers,
their selection by a traced index, and that a new policy needs no other edit.

Expected values are the SPEC's rules by hand (``helpers``); the seed
hardware and model are built here from the SPEC's figures, without configs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import BW, FLOPS, HD, KVH, LAYERS, MEM, PARAMS, QH, USD, decode
from hypothesis import given, settings
from hypothesis import strategies as st

from sweep.config.schema import Batching
from sweep.exported import jit
from sweep.model import batching
from sweep.model.params import GridPoint, HardwareParams, ModelParams, WorkloadParams
from sweep.model.point import evaluate_point

RTOL = 1e-5  # float32 model against float64 hand numbers (as tests/test_roofline.py)

HW = HardwareParams(*map(jnp.float32, (BW, FLOPS, MEM, 900e9, USD, 1.0, 1.0, 0.0,
                                       1.0)))
MODEL = ModelParams(*map(jnp.float32, (PARAMS, 0.0, PARAMS, LAYERS, QH, KVH, HD,
                                       4096.0, 1.0, 2.0, 2.0)))
WL = WorkloadParams(jnp.float32(1500), jnp.float32(360),
                    jnp.array([100.0, 300.0, 800.0, 2000.0], jnp.float32),
                    jnp.array([0.5, 0.3, 0.15, 0.05], jnp.float32))


def test_registry_matches_what_a_config_may_name():
    assert set(batching.NAMES) == {b.value for b in Batching}
    assert len(set(batching.NAMES)) == len(batching.POLICIES)
    for i, name in enumerate(batching.NAMES):
        assert batching.index(name) == i
        assert batching.policy(name) is batching.POLICIES[i]
    assert batching.CONTINUOUS_NAMES == ("continuous",)
    with pytest.raises(ValueError, match=r"batching = 'eager': unknown policy; "
                       "allowed: request, static, continuous"):
        batching.index("eager")


# (policy, running at concurrency 8, slot utilisation at padded 0.4, continuous)
SHIPPED = [("request", 1, 1.0, False), ("static", 8, 0.4, False),
           ("continuous", 8, 1.0, True)]


@pytest.mark.parametrize(("name", "running", "utilization", "continuous"), SHIPPED)
def test_each_policy_answers_by_hand(name, running, utilization, continuous):
    i = batching.index(name)
    got = batching.running(i, jnp.float32(8.0))
    assert got.dtype == jnp.float32 and float(got) == running
    # the simulator's concurrency is an int32 slot count: it stays one
    got = batching.running(jnp.int32(i), jnp.int32(8))
    assert got.dtype == jnp.int32 and int(got) == running
    assert float(batching.slot_utilization(i, jnp.float32(0.4))) == pytest.approx(
        utilization)
    assert bool(batching.is_continuous(i)) is continuous


def test_traced_index_under_jit_and_vmap_equals_a_loop():
    index = jnp.arange(len(batching.POLICIES), dtype=jnp.int32)
    conc = jnp.float32(64.0)

    @jit
    def answers(i):
        return (batching.running(i, conc), batching.slot_utilization(i, conc / 128),
                batching.is_continuous(i))

    got = jax.vmap(answers)(index)
    for i, p in enumerate(batching.POLICIES):
        assert float(got[0][i]) == float(p.running(conc))
        assert float(got[1][i]) == float(p.slot_utilization(conc / 128))
        assert bool(got[2][i]) is p.continuous
    assert [a.shape for a in got] == [(len(index),)] * 3


@settings(max_examples=30, deadline=None)
@given(concurrency=st.integers(1, 4096), padded=st.floats(0.01, 1.0))
def test_policies_obey_the_slot_laws(concurrency, padded):
    # no policy runs more sequences than the concurrency allows, and no slot
    # emits more than one token a step: 1 <= running <= c, padded <= util <= 1
    for p in batching.POLICIES:
        run = float(p.running(jnp.float32(concurrency)))
        util = float(p.slot_utilization(jnp.float32(padded)))
        assert 1.0 <= run <= concurrency
        assert np.float32(padded) <= util <= 1.0


class Halves(batching.Policy):
    """A policy for the test: half the slots run, continuously."""

    name = "halves"
    continuous = True

    def running(self, concurrency):
        return concurrency / 2


def test_a_new_policy_is_one_class_and_its_registration(monkeypatch):
    monkeypatch.setattr(batching, "POLICIES", (*batching.POLICIES, Halves()))
    i = len(batching.POLICIES) - 1
    pt = GridPoint(*map(jnp.float32, (1, 64, 2048, 1500)), jnp.int32(i),
                   jnp.float32(8192), jnp.float32(1e8))
    out = evaluate_point(HW, MODEL, WL, pt, jnp.float32(0.5))
    # the roofline runs 32 sequences at context 1,500 (the seed table's 7.00 ms)
    np.testing.assert_allclose(float(out["step_s"]), decode(32, 1500), rtol=RTOL)
    np.testing.assert_allclose(float(out["output_tokens_per_s"]),
                               32 / decode(32, 1500), rtol=RTOL)
    assert float(out["slot_utilization"]) == 1.0
    # continuous: the chunked-prefill interference is computed, not NaN
    assert np.isfinite(float(out["long_prefill_s"]))


def test_a_question_one_policy_answers_differently_is_one_where():
    # what the hand-written branches compiled to, so that moving a model onto
    # the policies leaves its compiled program (and its cube) as it was
    b, c, u = jnp.int32(1), jnp.int32(8), jnp.float32(0.4)

    def same(f, g, *args):
        assert str(jax.make_jaxpr(f)(*args)) == str(jax.make_jaxpr(g)(*args))

    same(batching.running, lambda b, c: jnp.where(b == batching.REQUEST, 1, c), b, c)
    same(batching.slot_utilization,
         lambda b, u: jnp.where(b == batching.STATIC, u, 1.0), b, u)
    same(batching.is_continuous, lambda b: b == batching.CONTINUOUS, b)
