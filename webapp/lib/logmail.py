"""The e-mail backend of a site without a mail server (DJANGO_EMAIL_HOST unset): each e-mail is one INFO line
of the site's log (Django's console backend wrote to stdout, which Celery's workers log as WARNING)."""

from __future__ import annotations

import logging

from django.core.mail.backends.base import BaseEmailBackend

log = logging.getLogger(__name__)


class LogBackend(BaseEmailBackend):
    def send_messages(self, email_messages) -> int:
        for message in email_messages:
            log.info("e-mail (no mail server set) to %s: %s | %s", ", ".join(message.to), message.subject,
                     " / ".join(line for line in message.body.splitlines() if line))  # fmt: skip
        return len(email_messages)
