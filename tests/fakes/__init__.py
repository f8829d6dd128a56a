"""Test doubles at third-party module boundaries (the code under test stays real)."""
