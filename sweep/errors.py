"""The error a user gets as one line and exit code 2.

It lives below every layer (no import of Hydra, omegaconf or JAX) so that
each one can raise it: the config schemas' checks (``sweep.config.schema``,
which re-exports it), the output-path checks (``sweep.cube.outputs``), the data
registry (``sweep.data``) and the plans (``sweep.grid.plan``).
"""


class ConfigError(ValueError):
    """A config that cannot describe a real deployment."""
