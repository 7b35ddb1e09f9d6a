"""How well three closed forms give the p99 wait of an M/G/1 queue.

The surrogate (``sweep/latency/surrogate/waiting.py``) models the prefill server's
wait as: busy with probability ``rho``, then the residual of the prompt in
service plus an exponential carrying the rest of the Pollaczek-Khinchine
mean. This script measures that form's p99 against the exact M/G/1 wait
(Lindley's recursion over 4M Poisson arrivals, the first 10 % dropped) for
service laws of mean 1, next to two alternatives:

* **exp**: busy with probability ``rho``, then one exponential with the
  conditional mean ``W / rho`` (exact for M/M/1);
* **CL**: the Cramér-Lundberg tail ``C exp(-eta x)``, ``eta`` solving
  ``lam (E[exp(eta X)] - 1) = eta``, ``C = (1 - rho) / (lam E[X exp(eta X)] - 1)``
  (Asmussen, *Applied Probability and Queues*, 2003, XIII.5); needs a light
  tail.

Ratios are closed form / exact; the surrogate under-predicts p99 TTFT at
utilisation 0.3-0.7 (``benchmarks/README.md``, "Surrogate vs simulator").

Usage: ``python benchmarks/mg1_wait_tail.py``
"""

from __future__ import annotations

import math

import numpy as np

rng = np.random.default_rng(0)
LAWS = {
    "deterministic": lambda n: np.ones(n),
    "exponential": lambda n: rng.exponential(1.0, n),
    "two-point (0.5 w.p. 0.8, 3)": lambda n: np.where(rng.random(n) < 0.8, 0.5, 3.0),
    "lognormal cv 1": lambda n: rng.lognormal(-0.3466, 0.8326, n),
    "lognormal cv 2": lambda n: rng.lognormal(-0.8047, 1.2686, n),
}


def exact_p99(lam, draw, n=4_000_000):
    """Lindley: W_k = U_k - min_{j <= k} U_j with U the walk of S - A."""
    walk = np.concatenate([[0.0], np.cumsum(draw(n - 1) - rng.exponential(1 / lam,
                                                                          n - 1))])
    wait = walk - np.minimum.accumulate(walk)
    return float(np.quantile(wait[n // 10:], 0.99))


def root(f, lo, hi, steps=200):
    for _ in range(steps):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if f(mid) < 0 else (lo, mid)
    return 0.5 * (lo + hi)


def closed_forms(lam, service):
    """p99 of the surrogate's form, of ``exp`` and of ``CL`` (service: samples)."""
    m1, m2 = service.mean(), (service**2).mean()
    rho = lam * m1
    wait = lam * m2 / (2 * (1 - rho))
    level = 1 - 0.01 / rho  # the conditional quantile that is the overall p99
    # residual of the prompt in service (length-biased, uniform position)
    k = 400_000
    pick = rng.choice(len(service), k, p=service / service.sum())
    residual = service[pick] * rng.random(k)
    rest = max(wait / rho - m2 / (2 * m1), 1e-12)
    surrogate = float(np.quantile(residual + rng.exponential(rest, k), level))
    expo = wait / rho * math.log(rho / 0.01)
    eta = root(lambda e: lam * (np.mean(np.exp(e * service)) - 1) - e,
               1e-9, 50 / service.max())
    c = (1 - rho) / (lam * np.mean(service * np.exp(eta * service)) - 1)
    return surrogate, expo, math.log(c / 0.01) / eta


def main():
    print("p99 wait / service mean; ratios to the exact value")
    print(f"{'service law':30s} {'rho':>5s} {'exact':>8s} {'surrogate':>10s} "
          f"{'exp':>6s} {'CL':>6s}")
    for name, draw in LAWS.items():
        service = draw(2_000_000)
        scale = service.mean()
        for rho in (0.1, 0.3, 0.5, 0.7, 0.85):
            exact = exact_p99(rho, lambda n: draw(n) / scale)
            forms = closed_forms(rho, service / scale)
            print(f"{name:30s} {rho:5.2f} {exact:8.3f} "
                  + " ".join(f"{f / exact:{w}.2f}" for f, w in zip(forms, (10, 6, 6))))


if __name__ == "__main__":
    main()
