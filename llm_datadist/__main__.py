"""``python -m llm_datadist``: the command line lives in ``llm_datadist.cli``."""

import sys

from llm_datadist.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
