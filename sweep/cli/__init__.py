"""The console scripts and what they share."""
