"""``python -m engine.serve --config served.yaml``: see :mod:`engine.serve.launch`."""

import sys

from engine.serve.launch import main

if __name__ == "__main__":
    sys.exit(main())
