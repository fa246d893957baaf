"""Device-image shim, put on PYTHONPATH by ``benchmarks/device/gpu_session.sh`` only.

The lent GPU machines' image carries torch 2.11, older than the 2.15 this project pins and CI
tests. Two calls the package makes are named differently there; this maps them to their 2.11
names at interpreter start, and does nothing under a torch that has them:

- ``DistributedDataParallel(forward_sync_buffers=...)`` is 2.11's ``broadcast_buffers``;
- ``torch.distributed.set_timeout(timeout, group)`` is 2.11's private ``_set_pg_timeout``.
"""

from __future__ import annotations

import datetime
import functools
import inspect

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

_INIT = DistributedDataParallel.__init__

if "forward_sync_buffers" not in inspect.signature(_INIT).parameters:

    @functools.wraps(_INIT)
    def _ddp_init(self: DistributedDataParallel, *args: object, **kwargs: object) -> None:
        if "forward_sync_buffers" in kwargs:
            kwargs["broadcast_buffers"] = kwargs.pop("forward_sync_buffers")
        _INIT(self, *args, **kwargs)

    DistributedDataParallel.__init__ = _ddp_init  # type: ignore[method-assign]

if not hasattr(dist, "set_timeout"):
    from torch.distributed.distributed_c10d import _set_pg_timeout

    def _set_timeout(timeout: datetime.timedelta, group: dist.ProcessGroup | None = None) -> None:
        _set_pg_timeout(timeout, group)

    dist.set_timeout = _set_timeout  # type: ignore[attr-defined]
