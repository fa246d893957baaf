"""AdamW's dense exchange across sites, started during backward (``DenseSum``).

Inside a site DDP averages each bucket of gradients as soon as backward has produced it (the
site's comm hook, ``DenseSum.hook``: torch's all-reduce hook over the site's ranks). Once every
gradient of a chunk is averaged, the chunk's fp32 sum over the live sites starts on the torchft
Managers' group, so the slow link's traffic runs beside the rest of backward, as DDP's own
all-reduce does inside one job, instead of after it.

The chunks are a plan that every site computes alike from the model (``chunk_plan``: the
trained parameters in reverse order, which is about the order backward produces their
gradients, cut at DDP's bucket sizes), not DDP's buckets, whose layout follows the order that
gradients became ready in a site's first backward and is not compared between sites. Every
site starts the same chunks in the same order, whichever bucket completes them.

The sync opens (the quorum waited for, the data positions' all-gather started:
``SiteLink.open_early``) at the first bucket of a step's last micro-batch. A site that heals in
this sync opens it after backward instead (its state is replaced when the sync opens, which
must not happen inside backward) and sends zeros chunk by chunk, as does a site's join (no
backward), so its collectives meet the live sites' in the same order. Source: DDP's gradient
bucketing and comm hooks (https://pytorch.org/docs/stable/ddp_comm_hooks.html).
"""


import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, Work
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from torchrun_ddp.parallel.shards import local_tensor
from torchrun_ddp.sites.link import SiteLink

log = logging.getLogger("torchrun_ddp")

FIRST_CHUNK_BYTES = 2**20
"""The first chunk's size in fp32 bytes, as DDP's first bucket (1 MiB): the last layers'
gradients, ready first, go out early."""


def chunk_plan(sizes: list[int], first_bytes: int, cap_bytes: int) -> list[list[int]]:
    """The chunks of parameters with ``sizes`` (elements each) in that order: each chunk a list
    of indices, closed once its fp32 bytes reach ``first_bytes`` (the first) or ``cap_bytes``
    (the others); a parameter larger than the cap is a chunk of its own. Raises ValueError for
    a cap below 1 byte."""
    if first_bytes < 1 or cap_bytes < 1:
        raise ValueError(f"chunk sizes must be at least 1 byte, got {first_bytes}, {cap_bytes}")
    chunks: list[list[int]] = [[]]
    filled = 0
    for index, size in enumerate(sizes):
        cap = first_bytes if len(chunks) == 1 else cap_bytes
        if chunks[-1] and filled + 4 * size > cap:
            chunks.append([])
            filled = 0
        chunks[-1].append(index)
        filled += 4 * size
    return [chunk for chunk in chunks if chunk]


@dataclass
class _Bucket:
    """A DDP bucket whose all-reduce inside the site is in flight: its future, parameters and
    their gradients (views of the bucket, the site's mean once the future is done)."""

    future: torch.futures.Future[torch.Tensor]
    params: list[torch.Tensor]
    grads: list[torch.Tensor]


class DenseSum:
    """The mean over the live sites of every gradient of ``params`` (the trained parameters
    in reverse order: ``backward_order``), chunk by chunk (module docstring). Set ``link``
    before the first step; ``arm`` before each step's forward; ``finish`` after backward.

    ``first_bytes`` and ``cap_bytes``: the chunks' fp32 sizes in bytes (``chunk_plan``)."""

    link: SiteLink | None = None

    def __init__(self, params: list[torch.Tensor], first_bytes: int, cap_bytes: int) -> None:
        self.params = params
        self.sizes = [local_tensor(param).numel() for param in params]
        self.chunks = chunk_plan(self.sizes, first_bytes, cap_bytes)
        self._index = {id(param): index for index, param in enumerate(params)}
        self.armed = False
        self.early = 0
        """The chunks of the last sync whose sum started before backward ended."""
        self._logged = False
        self._reset()

    def _reset(self) -> None:
        self._opened = self._deferred = False
        self._error: RuntimeError | None = None
        self._buckets: list[_Bucket] = []
        self._ready: dict[int, torch.Tensor] = {}
        self._sums: list[tuple[torch.Tensor, Work | None]] = []

    def site_link(self) -> SiteLink:
        """The link; raises AssertionError before it is set."""
        assert self.link is not None, "DenseSum needs its link before a step"
        return self.link

    def arm(self) -> None:
        """The next backward's buckets start the exchange (call before a step's forward)."""
        self.armed = True

    def hook(
        self, group: ProcessGroup | None, bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        """DDP's comm hook inside the site (``site_hook``): torch's all-reduce hook (the mean
        over the site's ranks, in the gradients' dtype); when armed, chunks that are complete
        start their sum across sites."""
        future = allreduce_hook(group, bucket)  # type: ignore[arg-type]
        if self.armed:
            self._buckets.append(_Bucket(future, bucket.parameters(), bucket.gradients()))
            self._advance()
        return future

    def _advance(self) -> None:
        """Open the sync early (once), file the buckets whose all-reduce is done, and start
        the chunks that are complete."""
        if self._opened or self._open_early():
            self._file(final=False)
            self._start_complete()

    def _file(self, final: bool) -> None:
        """File the gradients of the buckets whose all-reduce is done (all, when ``final``)."""
        for bucket in [bucket for bucket in self._buckets if final or bucket.future.done()]:
            bucket.future.wait()
            self._buckets.remove(bucket)
            for param, grad in zip(bucket.params, bucket.grads, strict=True):
                self._ready[self._index[id(param)]] = grad

    def _start_complete(self) -> None:
        """Start every chunk, in plan order, whose gradients are all filed."""
        while len(self._sums) < len(self.chunks):
            chunk = self.chunks[len(self._sums)]
            if not all(index in self._ready for index in chunk):
                return
            self._start(chunk)

    def _open_early(self) -> bool:
        """Open the sync from the hook, once; a site that heals in it, or a quorum that cannot
        be formed (raised again by ``finish``), leaves it to ``finish``."""
        if self._deferred:
            return False
        try:
            self._opened = self.site_link().open_early()
        except RuntimeError as exc:
            self._error = exc
        self._deferred = not self._opened
        return self._opened

    def _start(self, chunk: list[int]) -> None:
        """Start the chunk's fp32 sum over the live sites (``SiteLink.start_sum``)."""
        flat = torch.cat([self._ready[index].reshape(-1) for index in chunk]).float()
        self._sums.append((flat, self.site_link().start_sum(flat)))

    def finish(self, contribute: bool = True) -> bool:
        """Collective over the live sites: the rest of the sync (after backward, or alone for a
        join): the chunks not yet started, their sums waited for, the vote; then, where it was
        committed, every parameter's gradient (created where missing) is the mean over the
        sites summed (``link.participants``). ``contribute`` False sends zeros. Returns whether
        the sync was committed. Raises RuntimeError as ``SiteLink.average``."""
        link, self.armed = self.site_link(), False
        try:
            if self._error is not None:
                raise self._error
            if not self._opened:  # a join, a heal, or a step the hook did not see
                link.open()
                self._buckets, self._ready = [], {}
            self.early = len(self._sums)
            self._file(final=True)
            self._fill(contribute)
            self._start_complete()
            for _, work in self._sums:
                link.wait_sum(work)
            committed = link.close()
            if committed:
                self._take_means(max(1, link.participants))
                self._log_overlap()
            return committed
        finally:
            self._reset()

    def _log_overlap(self) -> None:
        """Log, once, how many chunks of a committed sync started during backward."""
        if self.early and not self._logged:
            self._logged = True
            log.info(
                "sites: the dense exchange started %d of its %d chunks during backward",
                self.early, len(self.chunks),
            )  # fmt: skip

    def _fill(self, contribute: bool) -> None:
        """File every gradient no bucket filed: the parameter's own (zeros where it has none,
        or where this site does not ``contribute``)."""
        for index, param in enumerate(self.params):
            if index in self._ready:
                continue
            local = local_tensor(param)
            grad = None if param.grad is None or not contribute else local_tensor(param.grad)
            self._ready[index] = torch.zeros_like(local) if grad is None else grad

    @torch.no_grad()
    def _take_means(self, participants: int) -> None:
        """Every gradient becomes its chunk's sum divided by ``participants``."""
        for chunk, (flat, _) in zip(self.chunks, self._sums, strict=True):
            flat.div_(participants)
            means = flat.split([self.sizes[index] for index in chunk])
            for index, mean in zip(chunk, means, strict=True):
                param = self.params[index]
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                local = local_tensor(param.grad)
                local.copy_(mean.view_as(local))


def site_hook(state: DenseSum, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's comm hook across fault-tolerant sites (``DenseSum.hook`` over the site's ranks)."""
    return state.hook(None, bucket)


def backward_order(model: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters of ``model`` that need gradients, in reverse order (``DenseSum``)."""
    return [param for param in model.parameters() if param.requires_grad][::-1]
