"""Operations a person or the API starts: diagnose a log, readiness, replay, bundles, return to
service, the auto-return consumer. Shared by the CLI and the API; imports neither.
"""
