"""`python -m workers.sitebench live --url http://127.0.0.1:PORT`: the site benchmark's entry point."""

import sys

from workers.sitebench.run import main

if __name__ == "__main__":  # not in the subscribers' process, which spawn starts by importing this module
    sys.exit(main())
