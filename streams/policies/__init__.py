"""The default policy (default.yaml), package data loaded by streams.policy."""
