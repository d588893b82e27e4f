"""`python -m fp4stack` runs the `fp4stack` command."""

import sys

from .cli import main

sys.exit(main())
