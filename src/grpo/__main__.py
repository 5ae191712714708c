"""`python -m grpo ...` (what torchrun launches) is the same as the `grpo` command."""

import sys

from grpo.cli import main

sys.exit(main())
