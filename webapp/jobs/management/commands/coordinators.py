"""`python manage.py coordinators`: host every running job's coordinator (what `make run` starts)."""

from django.core.management.base import BaseCommand, CommandError

from webapp.jobs.coordinating import serve


class Command(BaseCommand):
    help = "Run the coordinators of running jobs (stores, recovery, administrators' actions) until stopped."

    def add_arguments(self, parser):
        parser.add_argument("--store-port", type=int, help="its store gateway's port (default ASTEROID_STORE_PORT)")

    def handle(self, *args, **options):
        if serve(options["store_port"]) != 0:
            raise CommandError("the coordinators could not start; the reason is logged above")
