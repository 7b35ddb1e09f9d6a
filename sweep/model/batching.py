"""Batching policies: how a replica groups requests into the batches it runs.

A policy answers, for one grid point, the questions the models ask of it:

* ``running(concurrency)``: how many sequences run at once;
* ``slot_utilization(padded_utilization)``: the share of the running slots
  that emit a token, given the share ``E[out] / E[max of B outputs]`` at
  ``B = concurrency`` that a batch kept until its longest output ends reaches
  (``sweep.model.cost.static_slot_utilization``);
* ``continuous``: whether requests join and leave the running batch between
  steps, as in vLLM, SGLang and TGI. Chunked prefill, the surrogate's
  queueing model and vLLM's engine flags exist only then.

The shipped policies are the SPEC's: continuous batching; static batching
(``transformers.generate``: a batch runs until its longest output ends); and
request-at-a-time serving, static batching with batches of one.

The ``batching`` axis holds a policy's index into ``POLICIES`` (int32, traced),
so one compiled program serves every policy. ``running``, ``slot_utilization``
and ``is_continuous`` ask their question of every registered policy (static
Python objects: each answer is a number or a few operations on the point's
scalars) and keep the traced policy's answer with ``jnp.where``, never a
Python branch on the index. Policies giving the same answer share it, so a
question on which one policy differs compiles to the one ``where`` a
hand-written branch would, and the cubes are bit for bit those of such
branches. Host code (cube analysis, plots) reads the same answers by name:
``policy(name)``.

Adding a policy: one class below with its three answers, its entry in
``POLICIES``, and its name in ``sweep.config.schema.Batching`` (what a user
may write; tests/test_batching.py checks that the two agree).
"""

from __future__ import annotations

import functools
import operator

import jax.numpy as jnp


class Policy:
    """What the models ask of a batching policy (scalars of one grid point).

    An answer is a Python number or a function of the arguments; returning an
    argument itself, or a number, lets policies that agree share it.
    """

    name: str
    continuous: bool  # requests join and leave the batch between steps

    def running(self, concurrency):
        """Sequences running at once (default: the concurrency)."""
        return concurrency

    def slot_utilization(self, padded_utilization):
        """Share of running slots emitting a token (default: every slot works)."""
        return 1.0


class Continuous(Policy):
    """vLLM-style continuous batching: a finished request's slot is refilled at
    the next step, so every slot works."""

    name = "continuous"
    continuous = True


class Static(Policy):
    """Static batching: a batch of ``concurrency`` requests runs until its
    longest output ends; finished members idle as padding."""

    name = "static"
    continuous = False

    def slot_utilization(self, padded_utilization):
        return padded_utilization


class Request(Policy):
    """Request-at-a-time: one sequence runs, whatever the concurrency axis says
    (static batching with batches of one, whose only slot always works)."""

    name = "request"
    continuous = False

    def running(self, concurrency):
        return 1


POLICIES: tuple[Policy, ...] = (Request(), Static(), Continuous())
"""The registry; the ``batching`` axis holds an index into it."""
NAMES = tuple(p.name for p in POLICIES)
"""The ``batching`` coordinate's possible values, in index order."""


def index(name: str) -> int:
    """The index of the policy called ``name`` (what the models receive)."""
    try:
        return NAMES.index(name)
    except ValueError:
        raise ValueError(f"batching = {name!r}: unknown policy; allowed: "
                         f"{', '.join(NAMES)}") from None


def policy(name: str) -> Policy:
    """The policy called ``name`` (a cube's ``batching`` coordinate value)."""
    return POLICIES[index(name)]


REQUEST, STATIC, CONTINUOUS = (index(n) for n in ("request", "static", "continuous"))
"""Indices of the shipped policies; ``CONTINUOUS`` (what vLLM runs) is the
simulator's and the optimizer's."""
CONTINUOUS_NAMES = tuple(p.name for p in POLICIES if p.continuous)
"""The policies under which vLLM's engine flags describe the deployment."""


def _select(batching, answers):
    """The answer of policy ``batching`` (a traced int32 index), given one
    answer per policy.

    The most common answer (the same object, or equal Python numbers) is the
    default; each policy answering otherwise costs one comparison and one
    ``jnp.where``. Bool answers compile to the comparisons alone.
    """
    keys = [(type(a), a) if isinstance(a, bool | int | float) else id(a)
            for a in answers]
    default = max(keys, key=keys.count)  # the first on a tie
    base = answers[keys.index(default)]
    other = [(i, a) for i, (k, a) in enumerate(zip(keys, answers)) if k != default]
    batching = jnp.asarray(batching)
    if all(isinstance(a, bool) for a in answers):
        if not other:
            return jnp.full(batching.shape, base)
        hit = functools.reduce(operator.or_, [batching == i for i, _ in other])
        return ~hit if base else hit
    out = base
    for i, a in other:
        out = jnp.where(batching == i, a, out)
    return jnp.asarray(out)


def running(batching, concurrency):
    """Sequences running at once under policy ``batching`` (an index, scalar);
    the dtype of ``concurrency``."""
    return _select(batching, [p.running(concurrency) for p in POLICIES])


def slot_utilization(batching, padded_utilization):
    """Share of running slots emitting a token under policy ``batching``."""
    return _select(batching, [p.slot_utilization(padded_utilization)
                              for p in POLICIES])


def is_continuous(batching):
    """Whether policy ``batching`` batches continuously (bool scalar)."""
    return _select(batching, [p.continuous for p in POLICIES])
