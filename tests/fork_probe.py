"""A rank for tests/test_launchers.py: writes what it was given, registers exit work of its own, and exits with
the code it was given (python -m tests.fork_probe OUT.json CODE)."""

import atexit
import json
import os
import sys

out = sys.argv[1]
atexit.register(lambda: open(out + ".atexit", "w").write("ran"))
json.dump({"argv": sys.argv[1:], "rank": os.environ.get("RANK"), "ppid": os.getppid(), "main": __name__,
           "name": open("/proc/self/comm").read().strip()}, open(out, "w"))
sys.exit(int(sys.argv[2]))
