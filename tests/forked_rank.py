"""A rank of ``forked_torchrun.py``: ``train.main`` on this process's arguments, in a fork of the
agent (torchrun ``--run-path``). A non-zero status (2 bad input, 143 stopped by a signal) ends
the process with it, so torchrun sees a failed worker as it does under ``train.py``; status 0
returns, so torchrun's worker wrapper can report the rank done."""

from __future__ import annotations

import sys

import train

if __name__ == "__main__":
    status = train.main(sys.argv[1:])
    if status:
        sys.exit(status)
