"""Entry point: `python -m engine plan|simulate|bench ...` (see engine/cli/)."""

from engine.cli import main

raise SystemExit(main())
