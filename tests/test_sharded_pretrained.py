"""--init pretrained under --data-parallel fsdp: only rank 0 reads the weights (from_pretrained of
a local folder written by save_pretrained), the other rank builds the shapes on the meta device,
and rank 0's weights are scattered to the shards. Real gloo ranks through the trainer's start."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from distributed_harness import SMALL_LLAMA, accumulating_args, run_distributed
from safetensors.torch import load_file
from tiny_models import digest
from transformers import AutoModelForCausalLM

from torchrun_ddp.config_io import parse_config
from torchrun_ddp.distributed import DistEnv
from torchrun_ddp.inputs import prepare_inputs
from torchrun_ddp.main import start
from torchrun_ddp.model import load_model_config


def _worker(rank: int, world_size: int, data: str, root: str) -> dict[str, str]:
    """Rank 0 saves SMALL_LLAMA drawn with seed 11; both ranks start an fsdp run from it.
    Returns the digests of the saved weights and of the sharded model's gathered weights."""
    folder = Path(root) / "pretrained"
    if rank == 0:
        torch.manual_seed(11)
        saved = AutoModelForCausalLM.from_config(load_model_config(str(SMALL_LLAMA)))
        saved.save_pretrained(folder)
    dist.barrier()
    argv = accumulating_args(
        Path(data), Path(root) / "out", 2, 0, "--data-parallel", "fsdp",
        "--model", str(folder), "--init", "pretrained",
    )  # fmt: skip
    config = parse_config(argv)
    env = DistEnv(rank=rank, world_size=world_size, local_rank=rank, local_world_size=world_size)
    trainer = start(config, env, torch.device("cpu"), prepare_inputs(config, env))
    gathered = {name: p.full_tensor() for name, p in trainer.model.named_parameters()}
    return {"saved": digest(load_file(folder / "model.safetensors")), "sharded": digest(gathered)}


def test_fsdp_starts_from_pretrained_weights_read_by_rank_0(
    sample_data: Path, tmp_path: Path
) -> None:
    """Both ranks' gathered shards are the saved weights, bit for bit."""
    ranks = run_distributed(_worker, 2, str(sample_data), str(tmp_path))
    assert ranks[0]["sharded"] == ranks[1]["sharded"] == ranks[0]["saved"]
