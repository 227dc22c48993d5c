"""The site's log filter: a request refused with a 4xx is one line in the log (who asked for what and the status),
not the traceback of the exception that refused it; a 5xx keeps its traceback."""

from __future__ import annotations

import logging


class RefusalsInOneLine(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        status = getattr(record, "status_code", None)
        if isinstance(status, int) and status < 500:
            record.exc_info, record.exc_text = None, None
        return True
