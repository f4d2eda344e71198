"""The API's log stays readable under hostile input: a request aiohttp can't parse (a header line too long, a
malformed request line, a bad chunk) is one warning line naming the client and the fault, not a traceback. The
client got its 400 from aiohttp already; the traceback says nothing about our code, and a client can make
thousands of them."""

from __future__ import annotations

import logging

from aiohttp.http_exceptions import HttpProcessingError

SERVER_LOGGER = "aiohttp.server"


class OneLineHttpErrors(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, HttpProcessingError):
            remote = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
            fault = " ".join(str(error.message or type(error).__name__).split())[:200]
            record.msg, record.args = "bad HTTP request from %s: %s %s", (remote, type(error).__name__, fault)
            record.exc_info, record.exc_text, record.stack_info = None, None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def install() -> None:
    """Once per process: aiohttp's server logger words parse errors in one line."""
    logger = logging.getLogger(SERVER_LOGGER)
    if not any(isinstance(f, OneLineHttpErrors) for f in logger.filters):
        logger.addFilter(OneLineHttpErrors())
