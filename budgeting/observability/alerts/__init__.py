"""Capacity alerts: finance's thresholds per account, their crossings, Prometheus gauges and the webhook."""
