"""The Recovery Console: a page served by the operator API, fed live from Kafka over SSE.

`LiveFeed` (live.py) reads the operator topics in a background thread;
`console_router` (routes.py) serves the page, its static files, the event
stream and the read endpoints the page needs.
"""

from trainmedic.web.console.live import LIVE_TOPICS, LiveFeed
from trainmedic.web.console.routes import console_router

__all__ = ["LIVE_TOPICS", "LiveFeed", "console_router"]
