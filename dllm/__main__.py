"""``python -m dllm ...``: the ``dllm`` command line."""

import sys

from dllm.cli import main

if __name__ == "__main__":
    sys.exit(main())
