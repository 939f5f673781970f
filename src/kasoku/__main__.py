"""`python -m kasoku`: the `kasoku` command."""

import sys

from .cli import main

sys.exit(main())
