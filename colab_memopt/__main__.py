"""`python -m colab_memopt ...`: the command line (colab_memopt.tooling.cli)."""

import gc
import sys

from colab_memopt.tooling.cli import main

code = main()
# The interpreter's last act is a full garbage collection over every object left (torch's, transformers', the
# plan's): 1-1.5 s on a 2-core machine, for a process about to end. Frozen, they are not scanned; the answer is
# already printed, and atexit handlers still run.
gc.freeze()
sys.exit(code)
