"""Config schemas, their registration, and loading validated configs."""
