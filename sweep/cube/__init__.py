"""The cube: its contract (every axis and variable, declared once), its store
and its analysis."""
