"""Faults for supervised engine workers that real ones show rarely, injected into the real worker process.

Tests put this folder first on the PYTHONPATH of `serve`; the gateway hands its environment to its workers, and
Python imports `sitecustomize` at every start. It acts only in an engine worker (`-m engine_service`):

- SIGUSR1 makes the worker exit with code 2, at once (as Intel MKL's fatal errors exit 2 under a worker that
  was ready: the supervisor must restart it, not take it for settings refused).
- TEST_WORKER_CHILD_PIDFILE: at start the worker starts a child that shares its stdin, stdout and stderr and
  outlives it (as torch inductor's compile workers do, for up to 60 s), and appends the child's pid to that file.
"""

import os
import signal
import subprocess
import sys

if "engine_service" in sys.orig_argv[1:3]:
    signal.signal(signal.SIGUSR1, lambda _signum, _frame: os._exit(2))
    if pidfile := os.environ.get("TEST_WORKER_CHILD_PIDFILE"):
        child = subprocess.Popen([sys.executable, "-S", "-c", "import time; time.sleep(600)"])
        with open(pidfile, "a", encoding="utf-8") as handle:
            handle.write(f"{child.pid}\n")
