"""`python manage.py coordinators`: host every running job's coordinator (what `make run` starts)."""

import logging
import threading
import time

from django.core.management.base import BaseCommand, CommandError

from webapp.jobs.coordinating import serve

log = logging.getLogger(__name__)


class Command(BaseCommand):
    help = "Run the coordinators of running jobs (stores, recovery, administrators' actions) until stopped."

    def add_arguments(self, parser):
        parser.add_argument("--store-port", type=int, help="its store gateway's port (default ASTEROID_STORE_PORT)")

    def handle(self, *args, **options):
        threading.Thread(target=load_planner, name="planner-load", daemon=True).start()
        if serve(options["store_port"]) != 0:
            raise CommandError("the coordinators could not start; the reason is logged above")


def load_planner() -> None:
    """Load the planner's compiled search and the simulator's loops (numba's cache) while nothing waits for them: a
    job's first re-plan after a lost device in this process took 1.1 s with them to load, 0.05 s after."""
    from engine.planners import kernel

    started = time.monotonic()
    try:
        kernel.warm()
    except Exception:  # re-plans load it themselves then
        log.exception("coordinators: loading the planner")
        return
    log.info("coordinators: the planner's compiled search is loaded (%.1f s)", time.monotonic() - started)
