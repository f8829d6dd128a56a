"""The HTTP API and the console served by `trainmedic run api` (and inside `up`)."""
