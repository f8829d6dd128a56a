"""The one source of truth for trainmedic's events, topics and keys."""
