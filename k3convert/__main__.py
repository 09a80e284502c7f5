"""``python -m k3convert`` (and ``torchrun -m k3convert verify ...``)."""

import sys

from .cli import main

sys.exit(main())
