"""Stable, content-derived identifiers so every consumer can be idempotent."""

from __future__ import annotations

import hashlib


def stable_id(prefix: str, *parts: object) -> str:
    digest = hashlib.blake2b(
        "\x1f".join(str(p) for p in parts).encode("utf-8", "surrogatepass"), digest_size=10
    ).hexdigest()
    return f"{prefix}-{digest}"
