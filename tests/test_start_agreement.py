"""Collective start-up decisions on 2 real gloo ranks (one spawn): with one shared folder (one
storage domain, the same path as a folder per node) rank 0 picks the checkpoint to resume and
every rank verifies it sees it; every rank evaluates on as many batches."""

from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from distributed_harness import run_distributed
from tiny_models import tiny_llama_config

from torchrun_ddp.build import build_eval_set
from torchrun_ddp.checkpoint import StartFlags, agree_on_start, single_layout
from torchrun_ddp.config import TrainConfig
from torchrun_ddp.distributed import DistEnv
from torchrun_ddp.errors import UserError
from torchrun_ddp.evaluation import evaluate
from torchrun_ddp.inputs import Inputs
from torchrun_ddp.main import rebuild_problem
from torchrun_ddp.metrics import check_records
from torchrun_ddp.model import build_model
from torchrun_ddp.parallel.ddp import wrap_ddp
from torchrun_ddp.training_data import load_tokenizer, open_documents

CPU = torch.device("cpu")


def _checkpoint(root: Path, step: int, run_id: str = "run-a") -> None:
    """The files the start-up decision reads: a complete step folder of 2 ranks and run.json."""
    folder = root / f"step-{step}"
    folder.mkdir(parents=True)
    meta = {"step": step, "run_id": run_id, "world_size": 2, "data_since": 0}
    (folder / "meta.json").write_text(json.dumps(meta))
    for rank in range(2):
        (folder / f"rank-{rank}.json").write_text("{}")
        (folder / f"rank-{rank}.safetensors").write_bytes(b"")
    (folder / "COMPLETE").write_text("")
    (root / "run.json").write_text(json.dumps({"run_id": run_id}))


def _start(
    rank: int, world_size: int, folder: Path, restarted: bool = False, **options: object
) -> object:
    """agree_on_start as ``main.start`` calls it for one shared folder, with checkpoint_dir "ckpt"
    relative to ``folder`` (this rank's view)."""
    os.chdir(folder)
    config = TrainConfig(checkpoint_dir="ckpt", output_dir="out", **options)
    flags = StartFlags(config.resume, config.resume_from, config.overwrite_output_dir, restarted)
    rebuild = partial(rebuild_problem, config)
    check = partial(check_records, Path(config.output_dir) / "metrics.jsonl")
    try:
        plan = agree_on_start(Path("ckpt"), single_layout(world_size), flags, rebuild, check)
    except (UserError, RuntimeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return [plan.path, plan.step, plan.run_id]


def _evaluate(rank: int, world_size: int, tokenizer_dir: str, eval_file: str) -> object:
    """build_eval_set + evaluate on a DDP model; rank 0 has more eval windows than rank 1."""
    tokenizer = load_tokenizer(tokenizer_dir)
    documents = open_documents([eval_file], "", "", "validation")
    config = TrainConfig(seq_length=8, batch_size=1, eval_batches=4)
    env = DistEnv(rank=rank, world_size=world_size)
    inputs = Inputs(tiny_llama_config(len(tokenizer)), tokenizer, documents, documents)
    eval_set = build_eval_set(config, env, inputs, CPU)
    model = build_model("tiny", inputs.model_config, "random", "fp32", 0, CPU)
    trainer = SimpleNamespace(
        model=wrap_ddp(model, CPU), eval_set=eval_set, device=CPU, questions=[]
    )
    trainer.config = config
    record = evaluate(trainer)
    return {"batches": len(eval_set), "eval_loss": record.get("eval_loss", -1.0)}


def _worker(rank: int, world_size: int, base: str, tokenizer_dir: str, eval_file: str) -> object:
    root = Path(base)
    return {
        "shared": _start(rank, world_size, root / "shared"),
        "stale": _start(rank, world_size, root / f"node-{rank}"),
        "no_resume": _start(rank, world_size, root / "shared", resume=False),
        "restarted": _start(rank, world_size, root / "shared", True, resume=False),
        "failure": _start(rank, world_size, root / "broken"),
        "eval": _evaluate(rank, world_size, tokenizer_dir, eval_file),
    }


@pytest.mark.slow  # builds and evaluates a model on 2 spawned ranks
def test_start_is_decided_by_rank_0_and_checked_by_every_rank(
    sample_data: Path, tmp_path: Path
) -> None:
    for step in (4, 8):
        _checkpoint(tmp_path / "shared" / "ckpt", step)
        _checkpoint(tmp_path / "node-0" / "ckpt", step)
    _checkpoint(tmp_path / "node-1" / "ckpt", 4)  # a stale view: step 8 is missing here
    _checkpoint(tmp_path / "broken" / "ckpt", 3)
    meta = tmp_path / "broken" / "ckpt" / "step-3" / "meta.json"
    meta.write_text(json.dumps({"step": "three", "world_size": 2}))  # a ValueError
    long_text = " ".join(f"word{i}" for i in range(40))
    docs = [
        long_text,
        "word0 word1 word2",
        long_text,
    ]  # by example: rank 0 gets 0 and 2, rank 1 gets 1
    eval_file = tmp_path / "eval.json"
    eval_file.write_text("".join(json.dumps({"text": text}) + "\n" for text in docs))
    tokenizer_dir = str(sample_data / "tokenizer" / "mistral-7b-v0.1")
    ranks = run_distributed(_worker, 2, str(tmp_path), tokenizer_dir, str(eval_file), timeout=240.0)
    assert ranks[0]["shared"] == ranks[1]["shared"] == ["ckpt/step-8", 8, "run-a"]
    for result in ranks:
        stale = result["stale"]
        assert stale.startswith("UserError: not every rank sees the checkpoint ckpt/step-8")
        assert "--checkpoint-dir on a file system shared by all nodes" in stale
        assert result["no_resume"].startswith("UserError: --no-resume: --checkpoint-dir ckpt")
    assert "(rank 1: ckpt/step-8 is not complete here)" in ranks[1]["stale"]
    # --no-resume applies to a job's first attempt: a torchrun restart resumes its own run
    assert ranks[0]["restarted"] == ranks[1]["restarted"] == ["ckpt/step-8", 8, "run-a"]
    # a failure on rank 0 that is not bad input: rank 0 raises it, the others say what it was
    assert ranks[0]["failure"].startswith("ValueError: invalid literal for int()"), ranks[0]
    assert ranks[1]["failure"].startswith(
        "RuntimeError: rank 0 failed deciding what to resume: ValueError: invalid literal"
    ), ranks[1]["failure"]
    assert ranks[0]["eval"]["batches"] == ranks[1]["eval"]["batches"] == 1, ranks
    assert ranks[0]["eval"]["eval_loss"] == ranks[1]["eval"]["eval_loss"] > 0
