"""`trainmedic up` and its parts: the runtime that starts every component, the supervisor that keeps
them running, the embedded broker and its watch, the streams worker entry and the metrics listener.
"""
