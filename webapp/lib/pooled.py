"""A thread gives its pooled database connection back as soon as it is done or waits, so a process needs only a few."""

from __future__ import annotations

import functools

from channels.db import database_sync_to_async
from django.db import connection


def give_back() -> None:
    """This thread's connection back to the process's pool (PostgreSQL with ASTEROID_DB_POOL_SIZE > 0), if it
    holds one outside a transaction: its next query takes one again. Without a pool, a no-op (it keeps its own)."""
    if connection.connection is None or connection.in_atomic_block:
        return
    if connection.settings_dict.get("OPTIONS", {}).get("pool"):
        connection.close()


def off_the_database_thread(fn):
    """`fn` awaitable on one of the event loop's executor threads instead of daphne's one database thread (where
    every socket's stored batches queue), its connection given back when it returns."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        finally:
            give_back()

    return database_sync_to_async(run, thread_sensitive=False)
