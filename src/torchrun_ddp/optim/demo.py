"""DeMo: decoupled momentum optimization, an optimizer that does its own communication.

Peng, Quesnelle & Kingma 2024, "DeMo: Decoupled Momentum Optimization", arXiv:2411.19870
(reference code: ``demo.py`` in github.com/bloc97/DeMo). Per parameter and optimizer step, on
every rank, with learning rate ``lr`` and the rank's own (not averaged) gradient ``g``:

1. momentum doubles as error feedback: ``delta <- beta * delta + lr * g`` (``beta = 0.999``);
2. ``delta`` is cut into tiles (a matrix [R, C] into ``r x c`` tiles, each side the largest
   divisor of R, of C, at most ``tile``; a vector into 1-D chunks) and each tile goes through
   the orthonormal 2-D (1-D) DCT-II;
3. the ``topk`` largest-magnitude coefficients of every tile are this rank's message: their
   values (rounded to ``value_dtype``) and positions in the tile; what the message carries is
   subtracted from ``delta`` (so ``delta`` keeps exactly what was not sent, rounding included);
4. one all-gather per step carries every parameter's message (values, then uint8/int16
   positions, as one uint8 payload per rank);
5. every rank decodes all ranks' messages the same way: each coefficient is averaged over the
   ranks that sent it, the tiles are inverse-transformed and the sign is taken;
6. the update is signSGD with decoupled weight decay: ``p <- p * (1 - lr * wd) - lr * sign(.)``.

Why DDP still wraps the model but does not reduce: the forward and backward keep going through
``DistributedDataParallel`` (parameter and buffer broadcast at construction, ``no_sync``
for gradient accumulation, the same loop as AdamW), but DeMo needs each rank's *local*
gradient, and its exchange is a sparse all-gather of momentum, not an all-reduce of gradients.
``compression.register_local_gradients`` therefore registers a comm hook that returns every bucket
unreduced (no communication), and :class:`DeMo` schedules its own collective in ``step()``, the
way modded-nanogpt's optimizers issue their own collectives. Turning DDP's all-reduce off with
``no_sync`` on every micro-batch would do the same, but would change the training loop; a hook is
one line where the model is built and keeps the loop optimizer-agnostic.

Determinism: every rank decodes the same gathered bytes with the same operations in rank order
(a scatter-add per rank, no index repeats within one rank's tile), so the parameters stay
bit-identical on all ranks; ``delta`` differs between ranks (it is local state).
"""

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from torchrun_ddp.compression.replicas import local_shard
from torchrun_ddp.compression.settings import TOPK_VALUE_DTYPES
from torchrun_ddp.compression.state import CompressionState
from torchrun_ddp.compression.transform import tile_shape
from torchrun_ddp.optim.codecs import TileCodec
from torchrun_ddp.optim.exchange import (
    Counter,
    InFlight,
    MessageExchange,
    assign_owners,
)

if TYPE_CHECKING:
    from torchrun_ddp.distributed import NodeGroups


@dataclass(frozen=True)
class DemoSettings:
    """DeMo's hyperparameters (defaults: the paper's). Checked by :func:`validate_demo`."""

    beta: float = 0.999
    """Momentum decay of ``delta <- beta * delta + lr * g``, 0 <= beta < 1."""
    topk: int = 32
    """Coefficients sent per tile (at most the tile's element count; 32 of 4096 in the paper)."""
    tile: int = 64
    """Largest tile side: each side is the largest divisor of its dimension at most this."""
    value_dtype: str = "bfloat16"
    """Dtype of the coefficient values on the wire: bfloat16 (default), float16 or float32."""
    sign: bool = True
    """Take the sign of the decoded average (DeMo). False: step along the average itself,
    ``p <- p - lr * mean(sent momentum)``; with ``topk`` = tile size that is SGD at learning rate
    ``lr ** 2`` on the mean gradient (the momentum holds ``lr * g``): the test of the decode."""


def validate_demo(settings: DemoSettings) -> None:
    """Raise ``ValueError`` with a one-line message naming the bad field and the fix."""
    if not 0.0 <= settings.beta < 1.0:
        raise ValueError(
            f"--demo-beta must be in [0, 1), got {settings.beta}; the paper uses 0.999"
        )
    if settings.topk < 1:
        raise ValueError(f"--demo-topk must be >= 1, got {settings.topk}; the paper uses 32")
    if settings.tile < 2:
        raise ValueError(f"--demo-tile-size must be >= 2, got {settings.tile}; the paper uses 64")
    if settings.value_dtype not in TOPK_VALUE_DTYPES:
        raise ValueError(
            f"unknown --demo-value-dtype {settings.value_dtype!r}; "
            f"use one of {', '.join(TOPK_VALUE_DTYPES)}"
        )


def tile_codec(shape: tuple[int, ...], settings: DemoSettings) -> TileCodec:
    """The codec of a parameter of ``shape`` under ``settings``: DCT tiles of sides at most
    ``settings.tile`` (:func:`.transform.tile_shape`), ``k = min(topk, tile elements)``."""
    sides = tile_shape(shape, settings.tile)
    return TileCodec(tuple(shape), sides, min(settings.topk, math.prod(sides)))


class DeMo(Optimizer):
    """DeMo (see the module docstring) as a ``torch.optim.Optimizer``.

    ``params``: parameters or parameter groups (each may set ``lr`` and ``weight_decay``;
    ``optim.parameter_groups`` puts norms and biases in a group without decay). ``step()``
    reads each parameter's *local* gradient (same dtype and shape as the parameter; a missing
    gradient counts as zero), exchanges one all-gather with the other ranks of
    ``process_group`` and updates the parameters in place. It is a collective: every rank must
    call it, in the same step. ``counter`` (e.g. ``CompressionState.count``) is told the bytes
    of that all-gather.

    ``node_groups`` (``distributed.new_node_groups``) makes the exchange node-aware
    (``optim.exchange``): the gradients must then be the node's mean (the hook of
    ``compression.local_gradients.register_local_gradients`` with ``node_groups``), and this
    rank keeps and sends the momentum of its share of the parameters only. ``overlap``: each
    step starts its exchange and applies the previous step's, so the all-gather runs during the
    next forward and backward (a one-step-delayed update: the gradient of step t+1 is taken
    before step t's update is applied); :meth:`flush` applies the last one. Without ``overlap``
    the step waits for its own.

    State per owned parameter: ``delta`` (the momentum, the parameter's shape, always fp32: in
    bf16, ``0.999 * delta`` would round back to ``delta`` and small ``lr * g`` would round
    away), created zero here, so ``state_dict`` is complete from the start (DCP's
    ``get_state_dict`` then never runs a step to create state) and a checkpoint restores it
    exactly; with ``overlap``, the update in flight (:class:`LocalMomentum` saves it).

    Raises ``ValueError`` for bad settings, and ``RuntimeError`` (from torch) without an
    initialised process group.
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter] | Iterable[dict[str, object]],
        lr: float,
        settings: DemoSettings | None = None,
        weight_decay: float = 0.0,
        process_group: dist.ProcessGroup | None = None,
        counter: Counter | None = None,
        node_groups: "NodeGroups | None" = None,
        overlap: bool = False,
    ) -> None:
        self.settings = settings or DemoSettings()
        validate_demo(self.settings)
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})
        self.value_dtype = TOPK_VALUE_DTYPES[self.settings.value_dtype]
        self.overlap = overlap
        self.pending: InFlight | None = None
        self.updates_applied = 0
        """Updates this process has applied (with ``overlap``: one step behind ``step()``)."""
        trained = self._trained()
        # a sharded model's tiles are cut from this rank's shard
        self.codecs = {p: tile_codec(tuple(local_shard(p).shape), self.settings) for p in trained}
        sizes = [self._message_bytes(self.codecs[p]) for p in trained]
        parts = node_groups.local_world_size if node_groups else 1
        owners = assign_owners(sizes, parts)
        self.owners = dict(zip(trained, owners, strict=True))
        self.local_rank = dist.get_rank(node_groups.intra) if node_groups else 0
        lengths = [
            sum(n for n, o in zip(sizes, owners, strict=True) if o == j) for j in range(parts)
        ]
        self.exchange = MessageExchange(lengths, process_group, node_groups, counter)
        for param in trained:
            if self.owners[param] == self.local_rank:
                self.state[param]["delta"] = torch.zeros_like(
                    local_shard(param), dtype=torch.float32
                )

    def _trained(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"] if p.requires_grad]

    def _message_bytes(self, codec: TileCodec) -> int:
        return codec.value_count * (self.value_dtype.itemsize + codec.index_dtype.itemsize)

    def payload_bytes(self) -> int:
        """Bytes of this rank's all-gather payload per step (see ``wire.demo_payload_bytes``;
        node-aware: the largest share's, to which every share is padded)."""
        return self.exchange.padded

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One DeMo step over all parameters (collective); returns ``closure()``'s loss if any.

        With ``overlap``: this step's exchange is started and left running, and the previous
        step's (finished meanwhile) is applied: every update lands one step late.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        trained = [(p, group) for group in self.param_groups for p in group["params"]]
        trained = [(p, group) for p, group in trained if p.requires_grad]
        if not trained:
            return loss
        mine = [(p, group) for p, group in trained if self.owners[p] == self.local_rank]
        messages = [self._compress(p, float(group["lr"])) for p, group in mine]
        message = torch.cat(messages) if messages else torch.zeros(0, dtype=torch.uint8)
        lrs = [(float(group["lr"]), float(group["weight_decay"])) for _, group in trained]
        flight = self.exchange.start(message.to(trained[0][0].device), lrs)
        if not self.overlap:
            self._apply(flight)
            return loss
        previous, self.pending = self.pending, flight
        if previous is not None:
            self._apply(previous)
        return loss

    @torch.no_grad()
    def flush(self) -> bool:
        """Apply the update still in flight (``overlap``; a collective when it is node-aware);
        True if there was one. Called at the end of training so the last step is not lost."""
        if self.pending is None:
            return False
        self._apply(self.pending)
        self.pending = None
        return True

    def _apply(self, flight: InFlight) -> None:
        """Decode every parameter's gathered messages and step it with ``flight``'s rates."""
        rows_by_owner = self.exchange.finish(flight)
        self.updates_applied += 1
        offsets = [0] * len(rows_by_owner)
        for param, (lr, decay) in zip(self._trained(), flight.lrs, strict=True):
            codec, owner = self.codecs[param], self.owners[param]
            size = self._message_bytes(codec)
            rows = rows_by_owner[owner][:, offsets[owner] : offsets[owner] + size]
            offsets[owner] += size
            direction = self._decode(codec, rows)
            local = local_shard(param)
            if decay:
                local.mul_(1.0 - lr * decay)
            local.add_(direction.to(local.dtype), alpha=-lr)

    def _compress(self, param: torch.Tensor, lr: float) -> torch.Tensor:
        """Momentum update, top-k per tile, subtraction of what is sent; the message as uint8:
        ``n_tiles * k`` values of ``value_dtype``, then as many positions of the codec's index
        dtype."""
        delta = self.state[param]["delta"]
        delta.mul_(self.settings.beta)
        if param.grad is not None:
            delta.add_(local_shard(param.grad), alpha=lr)
        codec = self.codecs[param]
        coeffs = codec.encode(delta)
        positions = coeffs.abs().topk(codec.k, dim=1, sorted=False).indices
        values = coeffs.gather(1, positions).to(self.value_dtype)
        sent = torch.zeros_like(coeffs).scatter_(1, positions, values.float())
        delta.sub_(codec.decode(sent))
        wire_positions = positions.to(codec.index_dtype)
        return torch.cat(
            [values.reshape(-1).view(torch.uint8), wire_positions.reshape(-1).view(torch.uint8)]
        )

    def _decode(self, codec: TileCodec, rows: torch.Tensor) -> torch.Tensor:
        """All ranks' messages of one parameter ([world_size, message bytes] uint8) -> the step
        direction in the parameter's shape (fp32): per coefficient the mean over the ranks that
        sent it, inverse DCT, sign (unless ``settings.sign`` is off)."""
        world, count = rows.shape[0], codec.value_count
        if not count:  # an empty shard: no tiles, nothing sent
            return torch.zeros(codec.shape, device=rows.device)
        split = count * self.value_dtype.itemsize
        # contiguous_format: a plain clone keeps the stride of a single row (one rank), which
        # an odd message length leaves unaligned for the value dtype's view
        dense = torch.contiguous_format
        values = rows[:, :split].clone(memory_format=dense).view(self.value_dtype).float()
        positions = rows[:, split:].clone(memory_format=dense).view(codec.index_dtype).long()
        shape = (world, codec.n_tiles, codec.k)
        values, positions = values.view(shape), positions.view(shape)
        total = values.new_zeros(codec.n_tiles, codec.tile_numel)
        senders = torch.zeros_like(total)
        ones = torch.ones_like(values[0])
        for rank in range(world):  # rank order: the same sums on every rank
            total.scatter_add_(1, positions[rank], values[rank])
            senders.scatter_add_(1, positions[rank], ones)
        direction = codec.decode(total / senders.clamp_min(1.0))
        return direction.sign_() if self.settings.sign else direction


class LocalMomentum:
    """A :class:`DeMo`'s state as per-rank checkpoint state (``state_dict`` /
    ``load_state_dict``).

    DeMo's momentum differs between ranks (it is each rank's error feedback), so it must not go
    through DCP with the replicated model: DCP saves a replicated tensor from one rank only, and
    every rank would resume with rank 0's momentum. This saves each rank's own, with parameter
    positions (``Optimizer.state_dict``'s numbering, across groups in order) as string keys
    (JSON + tensors, nothing pickled). Loading copies into the existing fp32 momentum rather
    than through ``Optimizer.load_state_dict``, which would cast it to a bf16 parameter's dtype.
    """

    def __init__(self, optimizer: DeMo) -> None:
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, object]:
        """``{"state": {"<position>": {"delta": tensor}}, "param_groups": [...]}``, plus
        ``"pending"`` with ``overlap``: the update in flight (waited for here), its gathered
        messages per owner ([senders, bytes] uint8) and its rates ([parameters, 2] float64)."""
        local = self.optimizer.state_dict()
        state = {str(index): values for index, values in local["state"].items()}
        saved: dict[str, object] = {"state": state, "param_groups": local["param_groups"]}
        flight = self.optimizer.pending
        if flight is not None:
            rows = self.optimizer.exchange.finish(flight)
            saved["pending"] = {
                "rows": {str(owner): part.contiguous() for owner, part in enumerate(rows)},
                "lrs": torch.tensor(flight.lrs, dtype=torch.float64),
            }
        return saved

    def load_state_dict(self, state_dict: Mapping[str, object], /) -> None:
        """Restore what ``state_dict`` returned on this rank, bit for bit (copied in place).

        Raises ``ValueError`` when the saved groups or owned parameters do not match this
        optimizer's (another node layout), or an update in flight meets a run without overlap.
        """
        groups = cast(list[Mapping[str, object]], state_dict["param_groups"])
        if len(groups) != len(self.optimizer.param_groups):
            raise ValueError(
                f"saved DeMo state has {len(groups)} parameter groups, not "
                f"{len(self.optimizer.param_groups)}"
            )
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        saved = cast(Mapping[str, Mapping[str, torch.Tensor]], state_dict["state"])
        owned = {index for index, p in enumerate(params) if "delta" in self.optimizer.state[p]}
        if {int(index) for index in saved} != owned:
            raise ValueError(
                "saved DeMo momentum covers other parameters than this rank's share (another "
                "--compression-scope or ranks per node); resume with the saved layout"
            )
        for index, values in saved.items():
            self.optimizer.state[params[int(index)]]["delta"].copy_(values["delta"])
        for group, saved_group in zip(self.optimizer.param_groups, groups, strict=True):
            group.update({key: value for key, value in saved_group.items() if key != "params"})
        self._load_pending(cast(Mapping[str, object] | None, state_dict.get("pending")))

    def _load_pending(self, pending: Mapping[str, object] | None) -> None:
        """Restore the update in flight (already gathered, so nothing is exchanged again)."""
        self.optimizer.pending = None
        if pending is None:
            return
        if not self.optimizer.overlap:
            raise ValueError(
                "the checkpoint holds a DeMo update in flight (--overlap-exchange); resume with "
                "--overlap-exchange"
            )
        rows = cast(Mapping[str, torch.Tensor], pending["rows"])
        lrs = cast(torch.Tensor, pending["lrs"]).tolist()
        device = self.optimizer._trained()[0].device  # checkpoint tensors load on the CPU
        parts = [rows[str(owner)].to(device, copy=True) for owner in range(len(rows))]
        empty = parts[0].new_empty(0)
        flight = InFlight(empty, None, [(float(lr), float(wd)) for lr, wd in lrs], parts)
        self.optimizer.pending = flight

    def load_reset(self, donor: Mapping[str, object] | None, lrs: list[float]) -> None:
        """Continue a rank whose own momentum is lost (no checkpoint folder holds it): the
        momentum stays zero (as built), the groups' hyperparameters and an update in flight
        (the same gathered messages on every rank) come from another rank's ``state_dict``
        ``donor``; without one, each group's learning rate is set to ``lrs`` (the schedule's
        last)."""
        if donor is None:
            for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
                group["lr"] = lr
            return
        groups = cast(list[Mapping[str, object]], donor["param_groups"])
        for group, saved_group in zip(self.optimizer.param_groups, groups, strict=True):
            group.update({key: value for key, value in saved_group.items() if key != "params"})
        self._load_pending(cast(Mapping[str, object] | None, donor.get("pending")))


def build_demo(
    param_groups: list[dict[str, object]],
    learning_rate: float,
    settings: DemoSettings,
    state: CompressionState,
    overlap: bool = False,
    process_group: dist.ProcessGroup | None = None,
) -> DeMo:
    """DeMo over ``param_groups`` (``optim.parameter_groups``: decoupled weight decay on
    matrices only), exchanging in ``process_group`` (default: ``state``'s; node-aware when
    ``state`` has node groups) and counting its bytes in ``state``; ``overlap``: see
    :class:`DeMo`."""
    return DeMo(
        param_groups,
        learning_rate,
        settings,
        process_group=process_group or state.process_group,
        counter=state.count,
        node_groups=state.node_groups,
        overlap=overlap,
    )
