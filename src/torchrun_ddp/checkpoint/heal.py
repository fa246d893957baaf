"""Healing a site from a live one without unpickling anything: torchft's checkpoint transport
interface (``torchft.checkpointing.CheckpointTransport``) carried by this project's own format.

torchft's Manager asks a live replica group to ``send_checkpoint`` its state to a group that
rejoins, and the rejoining group to ``recv_checkpoint`` it, before its next step (torchft's
``manager.py``, ``_async_quorum``). Both of torchft's own transports unpickle what a peer sends:
``HTTPTransport`` loads with ``weights_only=False`` and ``PGTransport`` unpickles its metadata.
``HealTransport`` sends the state as JSON, safetensors and SHA-256 instead (``STREAM_FORMAT``):

- a header: JSON (``split_tree``'s skeleton: tensors replaced by placeholders), the step, and
  the sizes of the safetensors file and of its own header;
- the file: every tensor (a DTensor: this rank's shard) as one safetensors file, streamed
  (``tensor_stream``): its header, then each tensor's bytes sent from the tensor itself in
  pieces of at most ``CHUNK_BYTES``, while a thread hashes the pieces already sent; the receiver
  receives them into one buffer, hashing each piece while the next arrives, and takes the
  tensors as views of it;
- a trailer: the file's SHA-256 (32 bytes), compared before anything received is used.

So hashing overlaps the wire on both sides, and neither side copies the state into a blob. All
travels over the Manager's process group (torchft's reconfigured ``ProcessGroupGloo``), by
point-to-point sends from the live group's rank to the same rank of the healing group. The
receiver refuses another format, another step, a header over ``MAX_HEADER_BYTES``, a file whose
layout does not hold, or a SHA-256 that differs (``ValueError``): the SHA-256 catches a damaged
transfer, not a malicious peer (the trust model: docs/fault-tolerance.md#fault-tolerant-sites).

``encode`` / ``decode`` are the same format for small records held whole (a data position's,
``sites.positions``): header JSON with the payload's SHA-256, and one safetensors blob.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta

import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_bytes
from torch.distributed import ProcessGroup
from torchft.checkpointing import CheckpointTransport

from torchrun_ddp.checkpoint.codec import join_tree, split_tree, tensor_keys, untied
from torchrun_ddp.checkpoint.ranks import JsonObject, json_int, json_object, json_str
from torchrun_ddp.checkpoint.tensor_stream import Layout, layout, read_layout
from torchrun_ddp.parallel.shards import local_tensor

log = logging.getLogger("torchrun_ddp")

FORMAT = "torchrun-ddp-heal-1"
"""The format ``encode``'s header names: JSON + one safetensors blob + its SHA-256."""
STREAM_FORMAT = "torchrun-ddp-heal-2"
"""What ``HealTransport.metadata`` advertises and its header names: JSON, then a safetensors
file streamed piece by piece, then its SHA-256."""
CHUNK_BYTES = 4 * 2**20
"""File bytes per send (4 MiB): small enough that hashing a piece overlaps sending the next,
large enough that a send's fixed cost is small (``benchmarks/heal_transfer.py --chunks-mib``)."""
MAX_HEADER_BYTES = 64 * 2**20
"""The largest header a receiver accepts (a length past it is refused before allocating)."""
DIGEST_BYTES = 32
"""The trailer: the file's SHA-256."""
_LENGTH_TAG, _HEADER_TAG, _PAYLOAD_TAG, _DIGEST_TAG = 1, 2, 3, 4


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
    project's streamed format (``STREAM_FORMAT``, module docstring); ``timeout`` bounds each send
    and receive, ``chunk_bytes`` the bytes of one send. ``last`` records the latest transfer's
    bytes and seconds (the heal's cost, logged by the caller)."""

    def __init__(
        self, group: ProcessGroup, timeout: timedelta, chunk_bytes: int = CHUNK_BYTES
    ) -> None:
        self.group = group
        self.timeout = timeout
        self.chunk_bytes = chunk_bytes
        self.last = Transfer()

    def metadata(self) -> str:
        """The format this rank serves (torchft hands it to the receiver)."""
        return STREAM_FORMAT

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: dict[str, object], timeout: timedelta
    ) -> None:
        """Send ``state_dict`` at ``step`` to each replica rank in ``dst_ranks`` (blocking, each
        send within ``timeout``): the header, then the safetensors file piece by piece while a
        thread hashes the pieces already sent, then the SHA-256. Raises RuntimeError from the
        process group on a lost peer, TypeError for a value neither a tensor nor JSON."""
        started = time.perf_counter()
        tensors: dict[str, torch.Tensor] = {}
        tree = split_tree(state_dict, "", tensors)
        plain = {key: local_tensor(value).contiguous() for key, value in untied(tensors).items()}
        file = layout(plain)
        header = json.dumps(
            {"format": STREAM_FORMAT, "step": step, "tree": tree, "bytes": file.size,
             "header_bytes": len(file.header)}
        ).encode()  # fmt: skip
        for dst in dst_ranks:
            self._send(_int64(len(header)), dst, _LENGTH_TAG, timeout)
            self._send(
                torch.frombuffer(bytearray(header), dtype=torch.uint8), dst, _HEADER_TAG, timeout
            )
        digest = self.trailer(self._send_file(file, plain, dst_ranks, timeout))
        for dst in dst_ranks:
            self._send(
                torch.frombuffer(bytearray(digest), dtype=torch.uint8), dst, _DIGEST_TAG, timeout
            )
        sent = (len(header) + file.size + len(digest)) * len(dst_ranks)
        self.last = Transfer(sent, time.perf_counter() - started, sent=True)

    def _send_file(
        self, file: Layout, tensors: dict[str, torch.Tensor], dst_ranks: list[int],
        timeout: timedelta,
    ) -> bytes:  # fmt: skip
        """Every piece of ``file`` to every rank of ``dst_ranks``, each hashed by a thread of its
        own while the next is sent (hashlib and gloo release the GIL); the SHA-256."""
        sha = hashlib.sha256()
        with ThreadPoolExecutor(max_workers=1) as hasher:
            hashed, sends = [], []
            for start, stop in file.pieces(self.chunk_bytes):
                piece = file.piece(tensors, start, stop)
                sends += [self.group.send([piece], dst, _PAYLOAD_TAG) for dst in dst_ranks]
                hashed.append(hasher.submit(sha.update, piece.numpy()))
            for work in sends:  # all posted at once: the wire never waits for this thread
                work.wait(timeout)
            for done in hashed:
                done.result()
        return sha.digest()

    def trailer(self, digest: bytes) -> bytes:
        """What the receiver checks the file against: its SHA-256 ``digest``."""
        return digest

    def _send(self, tensor: torch.Tensor, dst: int, tag: int, timeout: timedelta) -> None:
        self.group.send([tensor], dst, tag).wait(timeout)

    def _recv(self, tensor: torch.Tensor, src: int, tag: int, timeout: timedelta) -> None:
        self.group.recv([tensor], src, tag).wait(timeout)

    def recv_checkpoint(
        self, src_rank: int, metadata: str, step: int, timeout: timedelta
    ) -> dict[str, object]:
        """Receive the state at ``step`` from replica rank ``src_rank`` (``metadata``: what it
        advertised): the header, the safetensors file into one buffer (each piece hashed while
        the next arrives), then the SHA-256; the tensors are views of the buffer. Raises
        ValueError for another format, a header over ``MAX_HEADER_BYTES``, another step, a
        file whose layout does not hold (``tensor_stream.read_layout``) or whose SHA-256
        differs."""
        if metadata != STREAM_FORMAT:
            raise ValueError(f"the healing peer serves {metadata!r}, not {STREAM_FORMAT!r}")
        started = time.perf_counter()
        length = _int64(0)
        self._recv(length, src_rank, _LENGTH_TAG, timeout)
        size = int(length.item())
        if not 0 < size <= MAX_HEADER_BYTES:
            raise ValueError(f"a healing peer announced a {size}-byte header")
        header_tensor = torch.empty(size, dtype=torch.uint8)
        self._recv(header_tensor, src_rank, _HEADER_TAG, timeout)
        header = _checked_header(json.loads(header_tensor.numpy().tobytes()))
        body, file = self._receive_file(src_rank, header, timeout)
        if json_int(header.get("step")) != step:  # checked once all came: the sender is done
            raise ValueError(
                f"a healing peer sent step {header.get('step')}, the quorum's is {step}"
            )
        state = join_tree(header["tree"], file.views(body))
        self.last = Transfer(size + file.size + DIGEST_BYTES, time.perf_counter() - started)
        return json_object(state)

    def _receive_file(
        self, src_rank: int, header: JsonObject, timeout: timedelta
    ) -> tuple[torch.Tensor, Layout]:
        """The safetensors file into one buffer, piece by piece, hashed as it comes; checked
        against the trailer."""
        total, head = json_int(header.get("bytes")), json_int(header.get("header_bytes"))
        if not 8 <= head <= min(total, MAX_HEADER_BYTES):
            raise ValueError(
                f"a healing peer announced a {head}-byte safetensors header of {total}"
            )
        body = torch.empty(total, dtype=torch.uint8)
        self._recv(body[:head], src_rank, _PAYLOAD_TAG, timeout)
        file = read_layout(body[:head].numpy().tobytes(), total)
        if tensor_keys(header["tree"]) != {entry.name for entry in file.entries}:
            raise ValueError("a healing peer's tensors are not the ones its state names")
        sha = hashlib.sha256(body[:head].numpy())
        pieces = [body[start:stop] for start, stop in file.pieces(self.chunk_bytes)[1:]]
        receives = [self.group.recv([piece], src_rank, _PAYLOAD_TAG) for piece in pieces]
        with ThreadPoolExecutor(max_workers=1) as hasher:
            hashed = []
            for piece, work in zip(pieces, receives, strict=True):
                work.wait(timeout)
                hashed.append(hasher.submit(sha.update, piece.numpy()))
            for done in hashed:
                done.result()
        trailer = torch.empty(DIGEST_BYTES, dtype=torch.uint8)
        self._recv(trailer, src_rank, _DIGEST_TAG, timeout)
        if trailer.numpy().tobytes() != sha.digest():
            raise ValueError("a healing peer's state does not match its SHA-256")
        return body, file


def _checked_header(value: object) -> JsonObject:
    """A received stream header of this format."""
    header = json_object(value)
    if header.get("format") != STREAM_FORMAT:
        raise ValueError(
            f"a healing peer sent format {header.get('format')!r}, not {STREAM_FORMAT!r}"
        )
    return header


def _int64(value: int) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.int64)
