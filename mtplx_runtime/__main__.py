"""`python -m mtplx_runtime` is the `mtplx` command."""

import sys

from .cli import main

sys.exit(main())
