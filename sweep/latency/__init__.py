"""Latency under arrivals: workloads, request streams, the simulator and the
surrogate."""
