"""Healing a site from a live one without unpickling anything: torchft's checkpoint transport
interface (``torchft.checkpointing.CheckpointTransport``) carried by this project's own format.

torchft's Manager asks a live replica group to ``send_checkpoint`` its state to a group that
rejoins, and the rejoining group to ``recv_checkpoint`` it, before its next step (torchft's
``manager.py``, ``_async_quorum``). Both of torchft's own transports unpickle what a peer sends:
``HTTPTransport`` loads with ``weights_only=False`` and ``PGTransport`` unpickles its metadata.
This transport sends the state the way node-local recovery stores it (``transfer``, ``codec``):

- a header: JSON (``split_tree``'s skeleton: tensors replaced by placeholders), the step, the
  payload's size in bytes and its SHA-256;
- the payload: every tensor in one safetensors blob (``safetensors.torch.save``), sent in
  chunks of ``CHUNK_BYTES`` into one buffer, hashed once it has all arrived.

Both travel over the Manager's process group (torchft's reconfigured ``ProcessGroupGloo``), by
point-to-point sends from the live group's rank to the same rank of the healing group. The
receiver refuses another format, another step, a header over ``MAX_HEADER_BYTES`` or a payload
whose SHA-256 differs (``ValueError``): the SHA-256 catches a damaged transfer, not a malicious
peer (the trust model: docs/fault-tolerance.md#fault-tolerant-sites).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta

import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_bytes
from torch.distributed import ProcessGroup
from torchft.checkpointing import CheckpointTransport

from torchrun_ddp.checkpoint.codec import join_tree, split_tree, untied
from torchrun_ddp.checkpoint.ranks import JsonObject, json_int, json_object, json_str
from torchrun_ddp.parallel.shards import local_tensor

log = logging.getLogger("torchrun_ddp")

FORMAT = "torchrun-ddp-heal-1"
"""What ``metadata`` advertises and the header names: JSON + safetensors + SHA-256."""
CHUNK_BYTES = 64 * 2**20
"""Payload bytes per send (64 MiB, as ``transfer``'s chunks): the memory a send holds."""
MAX_HEADER_BYTES = 64 * 2**20
"""The largest header a receiver accepts (a length past it is refused before allocating)."""
_LENGTH_TAG, _HEADER_TAG, _PAYLOAD_TAG = 1, 2, 3


@dataclass
class Transfer:
    """The last transfer this rank made: ``sent`` or received ``bytes`` (header + payload) and
    its wall-clock ``seconds``."""

    bytes: int = 0
    seconds: float = 0.0
    sent: bool = False


def encode(state: object, step: int) -> tuple[bytes, bytes]:
    """``(header, payload)`` of a state tree (nested dicts, lists and tuples of tensors and JSON
    values): the payload is the tensors (a DTensor: this rank's shard) as one safetensors blob
    (on the CPU, contiguous), the header UTF-8 JSON ``{"format", "step", "tree", "bytes",
    "sha256"}``. Raises TypeError for a value neither a tensor nor JSON."""
    tensors: dict[str, torch.Tensor] = {}
    tree = split_tree(state, "", tensors)
    cpu = {key: local_tensor(value).cpu().contiguous() for key, value in untied(tensors).items()}
    payload = safetensors_bytes(cpu)
    header = {
        "format": FORMAT,
        "step": step,
        "tree": tree,
        "bytes": len(payload),
        "sha256": hashlib.sha256(payload).hexdigest(),
    }
    return json.dumps(header).encode(), payload


def decode(header: JsonObject, payload: bytes, step: int) -> object:
    """The state tree from a received ``header`` and ``payload`` (``encode``'s inverse).

    Raises ValueError for another format or step, or a payload whose size or SHA-256 differs
    from the header's."""
    if header.get("format") != FORMAT:
        raise ValueError(f"a healing peer sent format {header.get('format')!r}, not {FORMAT!r}")
    if json_int(header.get("step")) != step:
        raise ValueError(f"a healing peer sent step {header.get('step')}, the quorum's is {step}")
    if len(payload) != json_int(header.get("bytes")):
        raise ValueError(
            f"a healing peer's payload has {len(payload)} bytes, not {header.get('bytes')}"
        )
    if hashlib.sha256(payload).hexdigest() != json_str(header.get("sha256")):
        raise ValueError("a healing peer's payload does not match its SHA-256")
    return join_tree(header["tree"], safetensors_load(payload))


class HealTransport(CheckpointTransport[dict[str, object]]):
    """torchft's ``CheckpointTransport`` over the Manager's process group ``group``, in this
    project's format (module docstring); ``timeout`` bounds each send and receive. ``last``
    records the latest transfer's bytes and seconds (the heal's cost, logged by the caller)."""

    def __init__(self, group: ProcessGroup, timeout: timedelta) -> None:
        self.group = group
        self.timeout = timeout
        self.last = Transfer()

    def metadata(self) -> str:
        """The format this rank serves (torchft hands it to the receiver)."""
        return FORMAT

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: dict[str, object], timeout: timedelta
    ) -> None:
        """Send ``state_dict`` at ``step`` to each replica rank in ``dst_ranks`` (blocking, each
        send within ``timeout``). Raises RuntimeError from the process group on a lost peer."""
        started = time.perf_counter()
        header, payload = encode(state_dict, step)
        length = torch.tensor([len(header)], dtype=torch.int64)
        header_tensor = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        body = _read_only_view(payload)  # never empty
        for dst in dst_ranks:
            self.group.send([length], dst, _LENGTH_TAG).wait(timeout)
            self.group.send([header_tensor], dst, _HEADER_TAG).wait(timeout)
            for start in range(0, len(payload), CHUNK_BYTES):
                chunk = body[start : start + CHUNK_BYTES]
                self.group.send([chunk], dst, _PAYLOAD_TAG).wait(timeout)
        sent = (len(header) + len(payload)) * len(dst_ranks)
        self.last = Transfer(sent, time.perf_counter() - started, sent=True)

    def recv_checkpoint(
        self, src_rank: int, metadata: str, step: int, timeout: timedelta
    ) -> dict[str, object]:
        """Receive the state at ``step`` from replica rank ``src_rank`` (``metadata``: what it
        advertised). Raises ValueError for another format, a header over
        ``MAX_HEADER_BYTES``, another step or a payload that does not match its SHA-256."""
        if metadata != FORMAT:
            raise ValueError(f"the healing peer serves {metadata!r}, not {FORMAT!r}")
        started = time.perf_counter()
        length = torch.zeros(1, dtype=torch.int64)
        self.group.recv([length], src_rank, _LENGTH_TAG).wait(timeout)
        size = int(length.item())
        if not 0 < size <= MAX_HEADER_BYTES:
            raise ValueError(f"a healing peer announced a {size}-byte header")
        header_tensor = torch.empty(size, dtype=torch.uint8)
        self.group.recv([header_tensor], src_rank, _HEADER_TAG).wait(timeout)
        header = json_object(json.loads(header_tensor.numpy().tobytes()))
        payload = self._receive_payload(src_rank, json_int(header.get("bytes")), timeout)
        state = decode(header, payload, step)
        self.last = Transfer(size + len(payload), time.perf_counter() - started)
        return json_object(state)

    def _receive_payload(self, src_rank: int, total: int, timeout: timedelta) -> bytes:
        """``total`` payload bytes from ``src_rank``, chunk by chunk."""
        if total < 0:
            raise ValueError(f"a healing peer announced {total} payload bytes")
        body = torch.empty(total, dtype=torch.uint8)
        for start in range(0, total, CHUNK_BYTES):
            chunk = body[start : start + CHUNK_BYTES]  # received in place
            self.group.recv([chunk], src_rank, _PAYLOAD_TAG).wait(timeout)
        return body.numpy().tobytes()


def _read_only_view(data: bytes) -> torch.Tensor:
    """``data`` as a uint8 tensor without a copy, for sending only (torch warns that the buffer
    is not writable: nothing writes to it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=torch.uint8)
