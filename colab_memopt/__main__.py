"""`python -m colab_memopt ...`: the command line (colab_memopt.tooling.cli)."""

import sys

from colab_memopt.tooling.cli import main

sys.exit(main())
