"""``python -m lightning_para.cli ...``: the ``lightning-para`` command."""

import sys

from lightning_para.cli import main

if __name__ == "__main__":
    sys.exit(main())
