"""`python -m workers` is `python -m workers.agent`."""

from workers.agent import main

raise SystemExit(main())
