"""User-facing errors: a mistake in the input, printed by the CLI as one line."""

import argparse


class UserError(Exception):
    """Bad input (unknown model, malformed cluster file, infeasible plan): shown as one line, exit 2."""


def known_fields(doc: dict, known: tuple[str, ...], where: str) -> None:
    """UserError naming the first key of `doc` not in `known` (a typo would otherwise be silently ignored and
    its default used); `where` prefixes the message, e.g. `cluster file: devices[0]`."""
    for key in doc:
        if key not in known:
            raise UserError(f"{where}: unknown field {str(key)!r:.40} (known: {', '.join(known)})")


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a usage mistake as one line, `<prog>: error: <message> (see --help)`, and exits 2.

    `error_first`: the line starts `error: ` instead (`error: <message> (see <prog> --help)`), for a command whose
    every other error is printed that way. Subcommands' parsers (parser_class) take it from their parent."""

    error_first = False

    def error(self, message: str):  # type: ignore[override]
        if self.error_first:
            self.exit(2, f"error: {message} (see {self.prog} --help)\n")
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


class ErrorFirstParser(OneLineParser):
    """OneLineParser whose line starts `error: `, like every other error of its command (the agent, the testbed)."""

    error_first = True
