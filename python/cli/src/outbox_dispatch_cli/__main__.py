"""``python -m outbox_dispatch_cli ARGS``: the command, in place of this
process (its exit status and signals are the command's)."""

import os
import sys

from outbox_dispatch_cli import find_bin

if __name__ == "__main__":
    command = find_bin()
    os.execv(command, [command, *sys.argv[1:]])
