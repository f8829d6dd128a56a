"""The streams worker process: `trainmedic run streams`, and what `trainmedic up` starts as
`python -m trainmedic.stack.streams_worker worker ...`. Its probe listener (/metrics, /healthz,
/readyz) comes from the settings metrics_host/metrics_port."""

from __future__ import annotations

import sys

from trainmedic.settings import Settings
from trainmedic.stack.metrics_server import MetricsServer


def main(argv: list[str] | None = None) -> None:
    settings = Settings.load()
    probes = (
        MetricsServer(settings.metrics_host, settings.metrics_port, roles=("streams",)).start()
        if settings.metrics_port
        else None
    )
    # Imported after the listener is up: the import builds the Faust app from the same settings.
    from streams.app import app

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    try:
        app.main()
    finally:
        if probes is not None:
            probes.stop()


if __name__ == "__main__":
    main()
