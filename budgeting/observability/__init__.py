"""Metrics (and logging) configuration."""
