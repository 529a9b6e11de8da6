"""`python -m genq`: the `genq` command."""

import sys

from genq.cli import main

sys.exit(main())
