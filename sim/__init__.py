"""Cluster simulator: training jobs that write realistic logs, kernel lines and
scheduler events, with fault injection and ground truth."""
