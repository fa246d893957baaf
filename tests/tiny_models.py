"""Models small enough that spawned gloo ranks build and train them in seconds, a helper that
runs the real trainer on a spawned rank, and the seeded parameters, gradients and micro-batches of
the optimizer tests (DeMo, DiLoCo, SparseLoCo)."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

import torch
from distributed_harness import SMALL_TOKENIZER
from torch.nn.parallel import DistributedDataParallel
from transformers import LlamaConfig

from torchrun_ddp.config_io import parse_config
from torchrun_ddp.distributed import DistEnv
from torchrun_ddp.inputs import prepare_inputs
from torchrun_ddp.main import Trainer, start, train
from torchrun_ddp.training_data import load_tokenizer
from torchrun_ddp.training_state import save_final_model

REPO = Path(__file__).resolve().parents[1]
# The tests' two tokenizers (the bundled Mistral one, SMALL_TOKENIZER), loaded into the
# per-process cache (``documents.load_tokenizer``) at import: ranks forked from a process that
# preloads this module (the fork server's PRELOAD, tests/forked_torchrun.py) do not parse them
# again in every training.
for _tokenizer in (REPO / "data" / "tokenizer" / "mistral-7b-v0.1", SMALL_TOKENIZER):
    load_tokenizer(str(_tokenizer))


def tiny_llama_config(vocab_size: int = 128) -> LlamaConfig:
    """2 layers, hidden 32, 4 heads, MLP 64, 64 positions; untied embeddings (transformers'
    default), about 16k parameters at vocabulary 128."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
    )


TINY_MODELS = ("gpt2", "qwen2", "mistral", "mixtral")
"""Tiny random-init configs of other architectures, in configs/tiny-models/<name>/config.json
(with llama/, the LoRA tests' model):
hidden 64, 2 layers, 4 heads, 128 positions, vocabulary 32000 (the bundled tokenizer's). GPT-2:
learned positions, GELU MLP of 4 x hidden, tied embeddings. Qwen2: q/k/v biases, tied
embeddings, grouped-query attention. Mistral: grouped-query attention, sliding window 64.
Mixtral: 4 experts of width 128, 2 per token."""


def tiny_model_path(name: str) -> Path:
    """The config.json of one of ``TINY_MODELS``."""
    return REPO / "configs" / "tiny-models" / name / "config.json"


def train_in_group(
    rank: int,
    world_size: int,
    argv: list[str],
    export: bool = True,
    per_node: int = 0,
    on_start: Callable[[Trainer], None] | None = None,
) -> Trainer:
    """Run one training job on an initialised process group, as ``main.run`` does after
    ``init_distributed``: the real inputs, DDP model, optimizer, data, loop, checkpoints and
    final outputs. Returns the trainer (the loop's state after the last step).

    With ``export=False`` the final model is not saved (under LoRA saving merges the adapters
    into the model, so call ``save_final_model`` after inspecting the trained adapters).
    ``per_node``: ranks per simulated node (0: all on one node). ``on_start``: called with the
    trainer once it is built and resumed, before its first step (e.g. to digest the resumed
    weights)."""
    config = parse_config(argv)
    per_node = per_node or world_size
    env = DistEnv(
        rank=rank, world_size=world_size, local_rank=rank % per_node, local_world_size=per_node
    )
    inputs = prepare_inputs(config, env)
    if config.threads:  # as main.run does (the harness already set cores / world size)
        torch.set_num_threads(config.threads)
    trainer = start(config, env, torch.device("cpu"), inputs)
    if on_start is not None:
        on_start(trainer)
    if train(trainer) and export:
        save_final_model(trainer)
    trainer.metrics.close()
    return trainer


class LogLines(logging.Handler):
    """The messages of the ``torchrun_ddp`` logger, every level from INFO, while installed::

    with LogLines() as log:
        train_in_group(...)
    assert "resumed from" in "\n".join(log.lines)
    """

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []
        self.logger = logging.getLogger("torchrun_ddp")
        self.level_before = self.logger.level

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def __enter__(self) -> LogLines:
        self.logger.addHandler(self)
        self.logger.setLevel(logging.INFO)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level_before)


def evaluations(output_dir: Path) -> dict[int, float]:
    """Step -> held-out loss of a run's metrics.jsonl."""
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["eval_loss"] for r in map(json.loads, lines) if "eval_loss" in r}


def comm_bytes(output_dir: Path) -> list[tuple[int, int]]:
    """(comm_bytes, comm_bytes_dense) of every training record of a run's metrics.jsonl."""
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    records = [r for r in map(json.loads, lines) if "loss" in r]
    return [(r["comm_bytes"], r["comm_bytes_dense"]) for r in records]


def digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over names, dtypes and raw bytes: equal digests mean bit-identical tensors."""
    sha = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        sha.update(f"{name}:{tensor.dtype}:{list(tensor.shape)}".encode())
        sha.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return sha.hexdigest()


def random_parameters(shapes: list[tuple[int, ...]], seed: int) -> list[torch.nn.Parameter]:
    """Standard-normal parameters of ``shapes``, the same for the same ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in shapes]


def random_gradients(shapes: list[tuple[int, ...]], step: int, rank: int) -> list[torch.Tensor]:
    """Standard-normal gradients of ``shapes``, one draw per (step, rank): each rank's own."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(shape, generator=generator) for shape in shapes]


def small_mlp(seed: int) -> torch.nn.Module:
    """Linear(16, 96), tanh, Linear(96, 4), initialised from ``seed``."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 96), torch.nn.Tanh(), torch.nn.Linear(96, 4))


def accumulate_local_batches(ddp: DistributedDataParallel, step: int, rank: int) -> None:
    """Backward of 2 accumulated micro-batches (the first under ``no_sync``) of this rank's own
    random regression data for ``step`` through ``small_mlp``'s DDP wrapper."""
    generator = torch.Generator().manual_seed(100 * step + rank)
    for micro in range(2):
        inputs = torch.randn(8, 16, generator=generator)
        target = torch.randn(8, 4, generator=generator)
        context = ddp.no_sync() if micro == 0 else torch.enable_grad()
        with context:
            loss = torch.nn.functional.mse_loss(ddp(inputs), target) / 2
            loss.backward()


def flat_parameters(module: torch.nn.Module) -> torch.Tensor:
    """All parameters of ``module``, flattened and concatenated (a copy)."""
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])
