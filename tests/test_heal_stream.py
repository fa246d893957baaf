"""The healing transfer of fault-tolerant sites, streamed (``checkpoint.tensor_stream``,
``checkpoint.heal.HealTransport``): a safetensors file sent piece by piece from the tensors
themselves and received into one buffer, its SHA-256 in a trailer.

Fast: the layout is a safetensors file that the safetensors library reads back; the pieces
cover the file once, in order, within their size; a received header that does not hold is
refused in one line. Between 2 real gloo ranks: a state of every dtype a training state holds,
tied and empty tensors included, crosses bit for bit to two receivers at once, in pieces of a
few bytes and of the default size; a wrong trailer (a damaged transfer), another step and another
format are refused.
"""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from distributed_harness import run_distributed
from safetensors.torch import load as safetensors_load

from torchrun_ddp.checkpoint.heal import STREAM_FORMAT, HealTransport
from torchrun_ddp.checkpoint.tensor_stream import layout, read_layout

TIMEOUT = timedelta(seconds=60)


def _tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "weight": torch.randn(5, 7, generator=generator),
        "half": torch.randn(3, 3, generator=generator).to(torch.bfloat16),
        "step": torch.tensor(12, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "bytes": torch.arange(11, dtype=torch.uint8),
        "empty": torch.zeros(0, 4),
        "double": torch.randn(2, generator=generator, dtype=torch.float64),
    }


def _file(tensors: dict[str, torch.Tensor], chunk: int) -> bytes:
    file = layout(tensors)
    return b"".join(
        file.piece(tensors, start, stop).numpy().tobytes() for start, stop in file.pieces(chunk)
    )


@pytest.mark.parametrize("chunk", [1, 5, 24, 4 * 2**20])
def test_the_streamed_layout_is_a_safetensors_file_cut_into_pieces(chunk: int) -> None:
    tensors = _tensors()
    file = layout(tensors)
    pieces = file.pieces(chunk)
    assert pieces[0] == (0, len(file.header))  # the header alone first
    assert [start for start, _ in pieces[1:]] == [stop for _, stop in pieces[:-1]]
    assert pieces[-1][1] == file.size
    assert all(stop - start <= chunk for start, stop in pieces[1:])
    data = _file(tensors, chunk)
    assert len(data) == file.size
    loaded = safetensors_load(data)  # the library reads what the stream sent
    assert set(loaded) == set(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor)
    body = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    views = read_layout(data[: len(file.header)], file.size).views(body)
    for name, tensor in tensors.items():
        assert torch.equal(views[name], tensor)
        if tensor.numel():
            assert views[name].untyped_storage().data_ptr() == body.untyped_storage().data_ptr()


def test_a_large_tensor_is_sent_from_its_own_memory_and_small_ones_merged() -> None:
    large = torch.randn(2**17)  # 512 KiB: MERGE_BYTES or more
    tensors = {"large": large, "a": torch.ones(3), "b": torch.zeros(5)}
    file = layout(tensors)
    pieces = file.pieces(300 * 2**10)
    assert len(pieces) == 1 + 1 + 2  # the header, "a" and "b" in 1, "large" in 2 (by name)
    first = file.piece(tensors, *pieces[2])
    assert first.untyped_storage().data_ptr() == large.untyped_storage().data_ptr()
    assert torch.equal(
        file.piece(tensors, *pieces[1]).view(torch.float32), torch.tensor([1.0] * 3 + [0.0] * 5)
    )


def _header(spec: dict[str, object]) -> bytes:
    text = json.dumps(spec).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


@pytest.mark.parametrize(
    ("spec", "size_after", "message"),
    [
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, 4, "end at"),
        ({"a": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, 8, "dtype or shape"),
        ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, 8, "8 bytes for"),
        ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, 8, "dtype or shape"),
        (
            {"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
             "b": {"dtype": "F32", "shape": [1], "data_offsets": [1, 5]}},
            5, "'b' is not where it belongs",
        ),
        (
            {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
             "b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
            4, "'b' is not where it belongs",
        ),
    ],
)  # fmt: skip
def test_a_received_safetensors_header_that_does_not_hold_is_refused(
    spec: dict[str, object], size_after: int, message: str
) -> None:
    header = _header(spec)
    with pytest.raises(ValueError, match=message):
        read_layout(header, len(header) + size_after)


def test_a_header_that_repeats_a_name_or_lies_about_its_length_is_refused() -> None:
    entry = b'{"dtype":"U8","shape":[1],"data_offsets":[0,1]}'
    text = b'{"a":' + entry + b',"a":' + entry + b"}"
    text += b" " * (-len(text) % 8)
    with pytest.raises(ValueError, match="repeats a tensor name"):
        read_layout(len(text).to_bytes(8, "little") + text, 8 + len(text) + 1)
    header = _header({})
    with pytest.raises(ValueError, match="does not match its length"):
        read_layout((len(header) + 8).to_bytes(8, "little") + header[8:], len(header))


class _Damaged(HealTransport):
    """A sender whose trailer does not match what it sent: what a damaged transfer looks like
    to the receiver."""

    def trailer(self, digest: bytes) -> bytes:
        return bytes([digest[0] ^ 0xFF]) + digest[1:]


def _state() -> dict[str, object]:
    tensors = _tensors()
    tied = tensors["weight"]
    return {"model": tensors, "tied": tied, "step": 12, "nested": [{"lr": 0.5}, (1, 2)]}


def _transfer(rank: int, world_size: int, chunk: int, case: str) -> list[object]:
    """Rank 0 sends ``_state()`` at step 7 to every other rank; each receiver returns what it
    took (or the error it raised)."""
    group = dist.group.WORLD
    assert group is not None
    transport = (_Damaged if case == "damaged" else HealTransport)(group, TIMEOUT, chunk)
    if rank == 0 and case == "format":
        return [0]  # the receiver refuses before it receives anything
    if rank == 0:
        transport.send_checkpoint(list(range(1, world_size)), 7, _state(), TIMEOUT)
        return [transport.last.bytes]
    step = 8 if case == "step" else 7
    metadata = "torchrun-ddp-heal-1" if case == "format" else transport.metadata()
    try:
        state = transport.recv_checkpoint(0, metadata, step, TIMEOUT)
    except ValueError as error:
        return [str(error)]
    # the tensors are views of one received buffer: cloned to cross the harness's queue
    return [_cloned(state), transport.last.bytes]


def _cloned(tree: object) -> object:
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {key: _cloned(value) for key, value in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_cloned(value) for value in tree)
    return tree


@pytest.mark.parametrize("chunk", [7, 4 * 2**20])
def test_a_state_crosses_to_two_receivers_bit_for_bit(chunk: int) -> None:
    sent, *received = run_distributed(_transfer, 3, chunk, "")
    expected = _state()
    for state, nbytes in received:
        assert nbytes * 2 == sent[0]  # the sender counts both receivers' bytes
        assert state["step"] == 12 and state["nested"] == [{"lr": 0.5}, (1, 2)]
        for name, tensor in expected["model"].items():
            got = state["model"][name]
            assert got.dtype == tensor.dtype and got.shape == tensor.shape
            assert torch.equal(got, tensor)
        assert torch.equal(state["tied"], expected["tied"])


def test_a_damaged_transfer_another_step_or_format_is_refused() -> None:
    for case, message in (
        ("damaged", "does not match its SHA-256"),
        ("step", "sent step 7, the quorum's is 8"),
        ("format", f"serves 'torchrun-ddp-heal-1', not '{STREAM_FORMAT}'"),
    ):
        _, [error] = run_distributed(_transfer, 2, 4 * 2**20, case)
        assert message in str(error)
