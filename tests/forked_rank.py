"""A rank of ``forked_torchrun.py``: ``train.main`` on this process's arguments, in a fork of the
agent (torchrun ``--run-path``). The fork inherits the agent's Python handlers of SIGTERM and
SIGINT (torchrun's, which raise an exception and so wait for a rank blocked in a collective or
a store, until torchrun's SIGKILL 30 s later): they are reset to a fresh interpreter's first.
A non-zero status (2 bad input, 143 stopped by a signal) ends the process with it, so torchrun
sees a failed worker as it does under ``train.py``; status 0 returns, so torchrun's worker
wrapper can report the rank done."""

from __future__ import annotations

import signal
import sys

import train

if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    status = train.main(sys.argv[1:])
    if status:
        sys.exit(status)
