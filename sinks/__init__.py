"""Consumers of trainmedic topics: the executor and the audit sink."""
