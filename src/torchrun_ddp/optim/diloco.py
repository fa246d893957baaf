"""DiLoCo: the pseudo-gradient all-reduced, then outer SGD with Nesterov momentum.

Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language Models",
arXiv:2311.08105. On the shared machinery of :class:`.local_updates.LocalUpdates` (inner AdamW
stepped locally, a sync every ``H = local_steps`` steps, overlapped syncs and eager updates), a
sync takes ``delta = mean_r delta_r`` of the ranks' pseudo-gradients ``delta_r = theta -
theta_r`` by one all-reduce (fp32, or bf16 on the wire: ``settings.pseudo_gradient_dtype``),
and the outer optimizer, ``torch.optim.SGD`` with Nesterov momentum, steps ``theta`` along
``delta`` (paper: outer lr 0.7, momentum 0.9, H = 500).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from torchrun_ddp.optim.local_update_config import PSEUDO_GRADIENT_DTYPES
from torchrun_ddp.optim.local_updates import LocalUpdates, PendingSync


class DiLoCo(LocalUpdates):
    """DiLoCo (module docstring) around an inner optimizer; see :class:`LocalUpdates` for the
    arguments, the state and the errors. ``node_groups`` is not used by the exchange (the
    all-reduce runs over ``process_group``; ``--compression-scope inter-node`` is refused for
    DiLoCo)."""

    def payload_bytes(self) -> int:
        """Bytes of this rank's all-reduce input per sync: every trained value in
        ``settings.pseudo_gradient_dtype`` (``wire.diloco_payload_bytes``)."""
        dtype = PSEUDO_GRADIENT_DTYPES[self.settings.pseudo_gradient_dtype]
        return sum(p.numel() for p in self.trained) * dtype.itemsize

    def _start_exchange(self, start: list[torch.Tensor]) -> PendingSync:
        """The pseudo-gradient ``synced - local`` in one fp32 buffer (``synced``'s gradients are
        views of it) and its all-reduce (fp32, or a bf16 wire copy), started."""
        flat, wire = self._pseudo_gradient()
        own = self._parts(wire.float()) if self.settings.eager else []
        self._count("all_reduce", wire.numel() * wire.element_size())
        work = dist.all_reduce(wire, group=self.process_group, async_op=True)
        return PendingSync(start, work=work, flat=flat, wire=wire, own=own)

    def _pseudo_gradient(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(flat, wire)``: the pseudo-gradient ``synced - local`` in one fp32 buffer [N]
        (``synced``'s gradients are views of it) and what goes on the wire (``flat`` itself,
        or its copy in ``settings.pseudo_gradient_dtype``)."""
        numel = sum(p.numel() for p in self.trained)
        flat = torch.empty(numel, dtype=torch.float32, device=self.synced[0].device)
        offset = 0
        for param, copy in zip(self.trained, self.synced, strict=True):
            view = flat[offset : offset + copy.numel()].view_as(copy)
            torch.sub(copy, param.float(), out=view)
            copy.grad = view
            offset += copy.numel()
        dtype = PSEUDO_GRADIENT_DTYPES[self.settings.pseudo_gradient_dtype]
        return flat, flat if dtype == torch.float32 else flat.to(dtype)

    def _parts(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """``flat`` (fp32 [N]) cut into the trained parameters' shapes (copies)."""
        sizes = [copy.numel() for copy in self.synced]
        pieces = flat.split(sizes)
        return [
            piece.view_as(copy).clone() for piece, copy in zip(pieces, self.synced, strict=True)
        ]

    def _finish_exchange(self, pending: PendingSync) -> None:
        """Wait for the all-reduce; ``flat`` (``synced``'s gradients) becomes the mean."""
        assert pending.flat is not None and pending.wire is not None and pending.work is not None
        pending.work.wait()
        if pending.wire is not pending.flat:
            pending.flat.copy_(pending.wire)
        pending.flat.div_(dist.get_world_size(self.process_group))
