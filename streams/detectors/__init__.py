"""Detectors: pure functions from records to anomalies, tested without a broker."""
