"""User-facing errors: a mistake in the input, printed by the CLI as one line."""


class UserError(Exception):
    """Bad input (unknown model, malformed cluster file, infeasible plan): shown as one line, exit 2."""
