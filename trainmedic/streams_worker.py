"""Entry point of the streams worker process: `python -m trainmedic.streams_worker worker ...`."""

from streams.app import app

if __name__ == "__main__":
    app.main()
