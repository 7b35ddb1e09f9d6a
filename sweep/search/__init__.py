"""The SLO search: optax descent, the Pareto filter and the search-simulate loop."""
