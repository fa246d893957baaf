"""The typed training config: one dataclass whose fields are the flags and config-file keys.

Every field's ``help`` text is what ``python train.py --help`` prints, and the ``# Section``
comments group the fields on the generated configuration page (``config_docs``). Reading a config
(flags, TOML files, input paths, the saved ``config.toml``) is ``config_io``; range and
combination checks are ``config_checks``.

It holds one concern only, the declaration of every flag (a default and a help text each, about
120 of them), and stays one flat dataclass over 500 lines on purpose: the flags, the TOML keys
and the generated page all come from this one list, and a flag is found by reading it top to
bottom by section.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torchrun_ddp.config_fields import OPTIMIZER_CHOICES, flag_name, opt

COMPRESSION_METHODS = ("none", "dct", "dct-topk", "fp16", "bf16", "powersgd")

__all__ = ["COMPRESSION_METHODS", "TrainConfig", "field_names", "flag_name"]


@dataclass
class TrainConfig:
    """Everything a training run needs; saved (without secrets) as ``<output_dir>/config.toml``."""

    # Model
    model: str = opt(
        "meta-llama/Llama-2-7b-hf",
        "Hugging Face hub id or local folder of a causal LM (any AutoModelForCausalLM), or a "
        "config.json path with --init random. Gated hub models need HF_TOKEN in the environment "
        "or .env.",
    )
    init: str = opt(
        "pretrained",
        "pretrained: load the weights with from_pretrained; random: build the architecture "
        "from the model's config and initialise it from --seed.",
        choices=["pretrained", "random"],
    )
    precision: str = opt(
        "fp32",
        "fp32: everything in float32. bf16-mixed: float32 weights, gradients and AdamW state, "
        "forward and backward under torch.autocast(bfloat16) on CPU and CUDA. bf16: bfloat16 "
        "weights, gradients and AdamW moments (half the memory; small updates can round away).",
        choices=["fp32", "bf16-mixed", "bf16"],
    )
    activation_checkpointing: bool = opt(
        False,
        "Recompute each decoder layer's activations in backward (transformers' gradient "
        "checkpointing, non-reentrant, DDP-safe): less memory, about a third more compute.",
    )
    compile: bool = opt(
        False,
        "torch.compile the model (inductor): under ddp the DDP module, under fsdp/hsdp each "
        "decoder layer; a graph that fails to compile stops the run with a one-line error (no "
        "silent eager fallback). "
        "Checkpoints stay loadable without compile.",
    )
    fused_loss: str = opt(
        "auto",
        "The training loss: liger computes lm_head and cross-entropy chunk by chunk (Liger "
        "Kernel's fused linear cross-entropy, CUDA only), never holding the [batch, seq, vocab] "
        "logits; none computes the logits, then transformers' cross-entropy. auto: liger on "
        "CUDA for model types Liger Kernel supports, else none. The held-out loss is always "
        "computed without it.",
        choices=["auto", "liger", "none"],
    )
    peft: str = opt(
        "none",
        "Parameter-efficient fine-tuning: none trains every weight; lora freezes the base model "
        "(bf16 unless --precision fp32) and trains fp32 low-rank adapters (peft).",
        choices=["none", "lora"],
    )
    lora_rank: int = opt(8, "--peft lora: rank r of each adapter (B A, A: r x in, B: out x r).")
    lora_alpha: float = opt(16.0, "--peft lora: scaling alpha; the update is (alpha / r) B A x.")
    lora_dropout: float = opt(0.1, "--peft lora: dropout on each adapter's input, in [0, 1).")
    lora_target_modules: list[str] = opt(
        ["all-linear"],
        "--peft lora: modules that get adapters, by name or name suffix (e.g. q_proj v_proj), "
        "or all-linear: every linear layer except the output head.",
    )
    tokenizer: str = opt("", "Tokenizer hub id or folder; empty means the same as --model.")
    # Data
    dataset: str = opt("allenai/c4", "Hub dataset streamed when --data-files is empty.")
    dataset_config: str = opt("en", "Config name of the hub dataset (C4: en); empty: none.")
    data_files: list[str] = opt(
        [],
        "Local training files (globs allowed): JSON lines (.json, .jsonl, .json.gz), .parquet, "
        ".arrow, or save_to_disk folders; overrides --dataset.",
    )
    eval_files: list[str] = opt(
        [],
        "Local held-out files (as --data-files); empty: --eval-fraction of --data-files, or the "
        "hub dataset's --eval-split without --data-files.",
    )
    shuffle_buffer: int = opt(
        1000,
        "Documents per shuffled block of the global document order (each block permuted by "
        "seed, epoch and block); 0 keeps stream order.",
    )
    max_bad_records: int = opt(
        100,
        "Damaged training records (bad JSON, bad UTF-8, no text, a damaged gzip stream) skipped "
        "with a warning naming the file and line; one more stops the run with an error.",
    )
    data_format: str = opt(
        "auto",
        "Example format of the data: text (documents under --text-field, packed back to back, "
        "every token trained), prompt-completion ({prompt, completion}: loss on the completion), "
        "messages ({messages: [{role, content}]}, rendered with the chat template: loss on the "
        "assistant turns), alpaca ({instruction, input, output}: read as prompt-completion in "
        "Stanford Alpaca's prompt), sharegpt ({conversations: [{from, value}]}: read as "
        "messages); auto: detected from the first record. See docs/data.md.",
        choices=["auto", "text", "prompt-completion", "messages", "alpaca", "sharegpt"],
    )
    text_field: str = opt("text", "The text field of text records.")
    chat_template: str = opt(
        "",
        "messages and sharegpt: a Jinja chat template file (final_model keeps it); empty: the "
        "tokenizer's own, or the bundled plain template where the tokenizer has none.",
    )
    train_on_prompt: bool = opt(
        False,
        "prompt-completion and messages: train on the prompt (system and user turns) too; "
        "off: their labels are -100 and the loss is on the answers only.",
    )
    packing: bool = opt(
        True,
        "Pack several examples into each window (kept apart: no token attends to another "
        "example, positions restart); false: one example per window, padded.",
    )
    separate_documents: bool = opt(
        False,
        "text: keep documents apart in their windows as examples are (per-document attention "
        "and positions); off: documents run on across windows, as in pretraining.",
    )
    eval_fraction: float = opt(
        0.0,
        "With --data-files and no --eval-files: hold out this fraction of each file's records "
        "(an even, deterministic slice) for evaluation; 0: no held-out evaluation.",
    )
    eval_multiple_choice: str = opt(
        "",
        "A file of multiple-choice questions ({query, choices, gold}: JSON lines or any type "
        "--data-files takes) scored at every evaluation by each choice's log-likelihood, "
        "reported as mc_accuracy and mc_accuracy_per_char; empty: none. See docs/data.md.",
    )
    dataset_split: str = opt("train", "Split of the hub dataset to train on.")
    eval_split: str = opt(
        "validation", "Split of the hub dataset to evaluate on; empty: no held-out evaluation."
    )
    seq_length: int = opt(512, "Tokens per packed training window.")
    batch_size: int = opt(4, "Micro-batch size in windows per rank.")
    accumulation_steps: int = opt(1, "Micro-batches accumulated per optimizer step.")
    keep_global_batch: bool = opt(
        False,
        "On resuming at another world size, keep the checkpoint's global batch (world size x "
        "--batch-size x accumulation) by changing --accumulation-steps; refused where the sizes "
        "do not divide. Off: the global batch follows the world size.",
    )
    # Optimisation
    learning_rate: float = opt(
        1e-5,
        "Peak learning rate of AdamW (of DeMo's sign step; of the inner AdamW under diloco and "
        "sparseloco).",
    )
    weight_decay: float = opt(0.01, "AdamW weight decay (not applied to norms and biases).")
    lr_scheduler: str = opt(
        "cosine-restarts",
        "Learning-rate schedule after --warmup-steps of linear warmup. cosine-restarts: cosine "
        "cycles from --learning-rate to --min-lr, restarting every --restart-every steps (SGDR); "
        "cosine: one cosine to --min-lr at --max-steps; linear: straight to 0 at --max-steps; "
        "constant; wsd: warmup-stable-decay, constant, then a linear decay to --min-lr over the "
        "last --decay-steps. cosine, linear, constant and wsd are transformers' schedulers (HF "
        "Trainer's lr_scheduler_type); cosine, linear and wsd need --max-steps.",
        choices=["cosine-restarts", "cosine", "linear", "constant", "wsd"],
    )
    warmup_steps: int = opt(250, "Optimizer steps of linear warmup.")
    restart_every: int = opt(
        1000,
        "--lr-scheduler cosine-restarts: length in optimizer steps of the first cosine cycle "
        "after warmup (T_0).",
    )
    restart_mult: int = opt(
        1, "--lr-scheduler cosine-restarts: factor by which each cycle is longer than the last."
    )
    min_lr: float = opt(
        0.0,
        "Learning rate at the bottom of each cosine cycle (cosine-restarts), at the end of "
        "cosine, and after wsd's decay.",
    )
    decay_steps: int = opt(
        0,
        "--lr-scheduler wsd: optimizer steps of the final decay; 0: the last fifth of --max-steps "
        "(Hagele et al. 2024, arXiv:2405.18392).",
    )
    adamw_implementation: str = opt(
        "fused",
        "AdamW kernel: fused (one kernel, fastest on CPU and CUDA), foreach (multi-tensor) or "
        "for-loop (torch's reference); all compute the same update.",
        choices=["fused", "foreach", "for-loop"],
    )
    optimizer: str = opt(
        "adamw",
        "The training method (one module each in methods/; docs/compression.md and "
        "docs/local_updates.md). Methods that exchange themselves need --compression none and "
        "no --zero1.",
        choices=OPTIMIZER_CHOICES,
    )
    demo_topk: int = opt(32, "--optimizer demo: DCT coefficients sent per tile (paper: 32).")
    demo_tile_size: int = opt(
        64, "--optimizer demo: largest tile side; each is the largest divisor <= this."
    )
    demo_beta: float = opt(0.999, "--optimizer demo: momentum decay in [0, 1) (paper: 0.999).")
    demo_value_dtype: str = opt(
        "bfloat16",
        "--optimizer demo: dtype of the coefficient values sent (indices: uint8/int16).",
        choices=["bfloat16", "float16", "float32"],
    )
    overlap_exchange: bool = opt(
        False,
        "--optimizer demo: start each step's all-gather and apply it one step later, so it runs "
        "during the next forward and backward (a one-step-delayed update). --optimizer "
        "diloco/sparseloco: keep taking inner steps while the sync's exchange runs and apply its "
        "outer update --sync-delay steps later, keeping the steps taken meanwhile.",
    )
    sync_delay: int = opt(
        0,
        "--optimizer diloco/sparseloco with --overlap-exchange: inner steps between a sync's "
        "start and its outer update, 1 to --local-steps (Streaming DiLoCo's tau, Douillard et al. "
        "2025, arXiv:2501.18512); 0: a whole window.",
    )
    eager_updates: bool = opt(
        False,
        "--optimizer diloco/sparseloco with --overlap-exchange: eager updates (Kale et al. 2025, "
        "arXiv:2502.12996): when a sync starts, each rank takes an outer step on its own estimate "
        "of the mean (the last mean with its own part swapped for its new one) and trains the "
        "delay's steps from there; the exact outer update replaces it when the exchange lands.",
    )
    local_steps: int = opt(
        0,
        "--optimizer diloco/sparseloco: optimizer steps between syncs (H); 0: the paper's, "
        "DiLoCo 500 (Douillard et al. 2023, arXiv:2311.08105), SparseLoCo 15 (Sarfi et al. 2025, "
        "arXiv:2508.15706; it reports H 15 to 250).",
    )
    outer_lr: float = opt(
        0.0,
        "--optimizer diloco/sparseloco: outer SGD learning rate; 0: the paper's, DiLoCo 0.7, "
        "SparseLoCo 1.",
    )
    outer_momentum: float = opt(
        0.9,
        "--optimizer diloco: outer Nesterov momentum in [0, 1) (paper: 0.9); 0: plain outer SGD. "
        "SparseLoCo has none (its error feedback takes that role).",
    )
    pseudo_gradient_dtype: str = opt(
        "float32",
        "--optimizer diloco: dtype of the all-reduced pseudo-gradient (bfloat16 halves the bytes).",
        choices=["float32", "bfloat16"],
    )
    sparseloco_topk: int = opt(
        64,
        "--optimizer sparseloco: values sent per chunk (64 of a 64 x 64 chunk: density 1/64, "
        "1.6 percent; the paper reports 1 to 3 percent).",
    )
    sparseloco_chunk: int = opt(
        64,
        "--optimizer sparseloco: largest chunk side; a matrix is cut into chunks of up to 64 x 64 "
        "= 4096 values (each side the largest divisor <= this, as DeMo's tiles), a vector into "
        "chunks of up to 64.",
    )
    sparseloco_beta: float = opt(
        0.95, "--optimizer sparseloco: error-feedback decay in [0, 1) (e <- beta e + delta)."
    )
    quant_bits: int = opt(
        2,
        "--optimizer sparseloco: bits per value sent, 1 to 8, with one fp32 scale per chunk "
        "(paper: 2); 0 sends fp32 values.",
    )
    sparseloco_quantizer: str = opt(
        "chunk",
        "--optimizer sparseloco: chunk: one fp32 scale per chunk, its largest magnitude, levels "
        "evenly spaced; statistical: Templar's, per tensor 2^bits bins over 6 standard "
        "deviations around the mean, each bin sent as the mean of its values.",
        choices=["chunk", "statistical"],
    )
    sparseloco_aggregate: str = opt(
        "all",
        "--optimizer sparseloco: all: the outer gradient is the mean of every rank's sent values "
        "(a value not sent counts as 0); senders: per value, the mean over the ranks that sent it "
        "(Templar).",
        choices=["all", "senders"],
    )
    sparseloco_clip: str = opt(
        "none",
        "--optimizer sparseloco: median: before the mean, each rank's message of a tensor is "
        "scaled down to the median of the ranks' norms (Templar's outer step).",
        choices=["none", "median"],
    )
    sparseloco_preset: str = opt(
        "none",
        "--optimizer sparseloco: templar fills the SparseLoCo settings that neither a flag nor "
        "the config file sets with Templar's production ones (tplr-ai/templar hparams.json, "
        "2025-09): --local-steps 30, --outer-lr 1, --sparseloco-beta 0.95, k 64 of 64 x 64 "
        "chunks, 2-bit statistical values, sender mean, median clipping.",
        choices=["none", "templar"],
    )
    max_grad_norm: float = opt(1.0, "Gradient clipping threshold (global L2 norm).")
    max_loss: float = opt(
        0.0,
        "Stop the run (status 2, no checkpoint over the last good one, no final_model) when a "
        "log step's loss is above this; 0: only a non-finite loss (NaN, inf) stops it. Checked "
        "on log steps, in the loss's own all-reduce.",
    )
    epochs: int = opt(1, "Passes over the training data.")
    max_steps: int = opt(-1, "Stop after this many optimizer steps; -1 means end of data.")
    seed: int = opt(42, "Seed for model init, data shuffle and dropout.")
    # Distributed and compression
    backend: str = opt(
        "auto",
        "Process-group backend; auto is NCCL with CUDA, else gloo.",
        choices=["auto", "gloo", "nccl"],
    )
    device: str = opt(
        "auto", "auto, cpu or cuda (cuda:LOCAL_RANK).", choices=["auto", "cpu", "cuda"]
    )
    timeout_s: int = opt(
        600,
        "Collective timeout in seconds for start-up (rendezvous, resume, the first step), "
        "checkpoint writes and the final export.",
    )
    train_timeout_s: int = opt(
        120,
        "Collective timeout in seconds once the first step has finished: how soon a rank that "
        "is gone without closing its connections (power loss, cut link) stops the others, "
        "so torchrun can restart. Must exceed the slowest step; 0 keeps --timeout-s.",
    )
    threads: int = opt(0, "torch intra-op threads per process; 0 means cores / local world size.")
    compression: str = opt(
        "none", "Gradient compression comm hook.", choices=list(COMPRESSION_METHODS)
    )
    compression_ratio: float = opt(
        0.5, "dct: fraction of DCT coefficients sent per block (0 < ratio <= 1)."
    )
    compression_block_size: int = opt(64, "dct, dct-topk: DCT block length in values.")
    compression_topk: int = opt(8, "dct-topk: largest DCT coefficients sent per block.")
    compression_value_dtype: str = opt(
        "float32",
        "dct, dct-topk: dtype of the DCT coefficients sent (dct all-reduces them; dct-topk "
        "all-gathers them with uint8/int16/int32 indices and feeds the rounding error back).",
        choices=["float32", "bfloat16", "float16"],
    )
    compression_error_feedback: bool = opt(
        True, "dct, dct-topk: add what was not sent to the next step's gradient."
    )
    compression_start_step: int = opt(
        0, "Optimizer steps of plain dense all-reduce before compression starts."
    )
    compression_selection: str = opt(
        "low-pass",
        "dct: coefficients sent, the same on every rank: low-pass (the lowest frequencies, no "
        "error feedback) or rotating (a cyclic walk through all frequencies, with error feedback).",
        choices=["low-pass", "rotating"],
    )
    compression_scope: str = opt(
        "global",
        "global: compress among all ranks; inter-node: dense reduce inside each node "
        "(LOCAL_WORLD_SIZE ranks), compress only between nodes (none, fp16, bf16, dct, and "
        "--optimizer demo or sparseloco).",
        choices=["global", "inter-node"],
    )
    plan_world_size: int = opt(0, "--dry-run: ranks to plan for; 0 means WORLD_SIZE.")
    plan_gpus_per_node: int = opt(8, "--dry-run: ranks per node for the communication plan.")
    plan_intra_node_gbit: float = opt(
        2400.0, "--dry-run: link bandwidth between ranks of one node, Gbit/s per direction."
    )
    plan_inter_node_gbit: float = opt(
        100.0, "--dry-run: link bandwidth between nodes, Gbit/s per direction per node."
    )
    plan_tflops: float = opt(
        0.0,
        "--dry-run: sustained training TFLOP/s per rank for the compute time; 0: the device's "
        "peak, as MFU divides by (--peak-tflops, else the visible GPU's data-sheet peak, else "
        "this CPU's measured matmul rate), so the time is a lower bound.",
    )
    powersgd_rank: int = opt(4, "powersgd: rank of the low-rank gradient approximation.")
    data_parallel: str = opt(
        "ddp",
        "ddp: every rank holds the whole model (DDP); fsdp: weights, gradients and optimizer "
        "state sharded over all ranks (FSDP2); hsdp: sharded within --shard-degree ranks, "
        "replicated across those groups, which exchange through FSDP's all-reduce, the "
        "--compression hook or DeMo's, DiLoCo's or SparseLoCo's own exchange (docs/sharded.md).",
        choices=["ddp", "fsdp", "hsdp"],
    )
    shard_degree: int = opt(
        0, "--data-parallel hsdp: ranks one replica is sharded over; 0 means LOCAL_WORLD_SIZE."
    )
    zero1: bool = opt(
        False,
        "Shard AdamW's state across the data-parallel ranks (ZeRO stage 1, torch's "
        "ZeroRedundancyOptimizer); each rank checkpoints its own shard.",
    )
    ddp_bucket_cap_mb: float = opt(
        25.0, "DDP gradient bucket size in MiB (all-reduce starts as each bucket fills)."
    )
    gradient_as_bucket_view: bool = opt(
        True,
        "Gradients are views into DDP's buckets (saves one gradient-sized copy); "
        "--no-gradient-as-bucket-view keeps separate copies.",
    )
    ddp_static_graph: bool = opt(
        False,
        "Tell DDP the autograd graph is the same every step (DDP static_graph): it then skips "
        "per-step graph checks. Valid where every trainable parameter gets a gradient every step "
        "(all tested causal LMs, MoE included).",
    )
    # Fault-tolerant sites
    fault_tolerance: str = opt(
        "none",
        "none: one torchrun job over every node, a lost node restarts it "
        "(docs/fault-tolerance.md); sites: each site is its own torchrun job and a torchft "
        "replica group, the sites meet through a torchft lighthouse (--lighthouse), a lost "
        "site's pseudo-gradient (or AdamW's gradient, DeMo's message) is dropped and the others "
        "train on, and a site that comes back heals from a live one "
        "(docs/fault-tolerance.md#fault-tolerant-sites).",
        choices=["none", "sites"],
    )
    site_id: int = opt(0, "--fault-tolerance sites: this site's index, 0 .. --sites - 1.")
    sites: int = opt(
        0,
        "--fault-tolerance sites: the sites the run trains on (each the same ranks); the data "
        "is split over sites x ranks, so each site trains its own documents.",
    )
    lighthouse: str = opt(
        "",
        "--fault-tolerance sites: the torchft lighthouse, host:port (or http://host:port); "
        "empty: the TORCHFT_LIGHTHOUSE variable.",
    )
    site_address: str = opt(
        "",
        "--fault-tolerance sites: the host this site advertises to the others for its store "
        "and its torchft manager (reachable from every site); empty: MASTER_ADDR for the store, "
        "the host name for the manager.",
    )
    site_store_port: int = opt(
        0,
        "--fault-tolerance sites: the port of the store this site's rank 0 hosts for its torchft "
        "managers (new in each attempt; open to the other sites); 0: a free port.",
    )
    quorum_timeout_s: int = opt(
        0,
        "--fault-tolerance sites: seconds a quorum may take, lighthouse retries included (the "
        "longest lighthouse outage survived); 0 means --train-timeout-s.",
    )
    quorum_retries: int = opt(
        10,
        "--fault-tolerance sites: retries of a failed lighthouse call within "
        "--quorum-timeout-s before the site's ranks fail (torchft's quorum_retries; on by "
        "default, torchft's own default is 0).",
    )
    site_timeout_s: int = opt(
        0,
        "--fault-tolerance sites: seconds a cross-site collective, commit vote or healing "
        "transfer may take (torchft's Manager timeout); 0 means --train-timeout-s.",
    )
    site_start_wait_s: int = opt(
        120,
        "--fault-tolerance sites: seconds a site waits at the start for all --sites sites to "
        "join before its first step (none heals into a run another began alone); past it, the "
        "sites that are up start and the others heal in when they come; 0: no wait.",
    )
    site_heartbeat_ms: int = opt(
        100,
        "--fault-tolerance sites: milliseconds between a site's heartbeats to the lighthouse; "
        "the lighthouse's --heartbeat_timeout_ms (run.sh: LIGHTHOUSE_HEARTBEAT_TIMEOUT_MS) "
        "must be several of them.",
    )
    # Checkpoints and resume
    checkpoint_dir: str = opt(
        "",
        "Folder of step-N checkpoints; empty means <output-dir>/checkpoints. On several nodes "
        "it may be one shared file system, or a folder of each node's or each site's own (see "
        "--checkpoint-storage).",
    )
    checkpoint_storage: str = opt(
        "auto",
        "Which ranks see one --checkpoint-dir. auto: found out at start (the ranks that see the "
        "same folder share it: one shared file system, one per site, or one per node); shared: "
        "every rank must see the same folder; node-local: every node (torchrun agent) has its "
        "own. With more than one folder, each holds the whole replicated state and its ranks' "
        "own, and a folder that lacks the checkpoint to resume gets it from a peer over the "
        "process group.",
        choices=["auto", "shared", "node-local"],
    )
    buddy_copies: int = opt(
        1,
        "With more than one checkpoint folder: how many other folders also keep each rank's own "
        "state (data position, RNGs, DeMo momentum, error feedback, ZeRO-1 shard), so that "
        "losing that many folders loses none of it; 0 keeps it in the rank's own folder only.",
    )
    checkpoint_every: int = opt(
        500, "Checkpoint every N optimizer steps (0: only at the end and on SIGTERM/SIGINT)."
    )
    keep_checkpoints: int = opt(3, "Complete checkpoints kept; older ones are deleted.")
    save_at_end: bool = opt(
        True,
        "At the end of training, checkpoint the last step and write final_model/ "
        "(--no-save-at-end: neither, for throughput runs and smoke tests; the --checkpoint-every "
        "checkpoints and the one on SIGTERM/SIGINT stay).",
    )
    resume: bool = opt(
        True, "Resume from the newest complete checkpoint in --checkpoint-dir (--no-resume: fresh)."
    )
    resume_from: str = opt("", "Resume from this step-N checkpoint folder instead of the newest.")
    verify_checkpoints: str = opt(
        "full",
        "How a checkpoint is checked against its manifest (each file's size and SHA-256, "
        "written before COMPLETE) before anything of it is loaded. full: sizes and SHA-256 (one "
        "read of each step kept); size: sizes only (a truncated or empty file, not flipped "
        "bytes); off: no check. A damaged step is set aside as step-N.damaged: a peer's intact "
        "copy or an older step is resumed instead.",
        choices=["full", "size", "off"],
    )
    overwrite_output_dir: bool = opt(
        False,
        "With --no-resume: delete the checkpoints and metrics.jsonl of the run already in "
        "--checkpoint-dir/--output-dir (without it such a start is refused).",
    )
    # Outputs
    output_dir: str = opt("outputs/run", "Folder for metrics.jsonl, config.toml and final_model/.")
    log_every: int = opt(10, "Log training metrics every N optimizer steps.")
    eval_every: int = opt(100, "Evaluate every N optimizer steps (and at the end); 0: end only.")
    eval_batches: int = opt(8, "Micro-batches of held-out windows per rank in each evaluation.")
    tensorboard: bool = opt(
        False, "Also write TensorBoard event files to <output-dir>/tensorboard."
    )
    report_to: str = opt(
        "none",
        "wandb: also log every metrics.jsonl record and the resolved config to Weights & Biases "
        "(needs the wandb extra: uv sync --extra wandb; project from WANDB_PROJECT, else "
        "torchrun-ddp; WANDB_MODE=offline writes the run to <output-dir>/wandb only). The wandb "
        "run's id is the checkpoint's run id, so a resumed run continues the same wandb run.",
        choices=["none", "wandb"],
    )
    peak_tflops: float = opt(
        0.0,
        "Peak TFLOP/s of one rank's device for MFU; 0: the GPU's data-sheet dense bf16 peak, "
        "or on CPU a short matmul measurement at start-up.",
    )
    dry_run: bool = opt(
        False,
        "Build the model on the meta device (no weights), print the per-rank memory and FLOP "
        "plan for these settings and the world size, and exit without training.",
    )
    device_memory_gib: float = opt(
        0.0, "Device memory per rank in GiB for the plan; 0: the visible GPU's, else 80."
    )
    verbose: bool = opt(False, "Debug logging, and library logs (transformers, datasets) at info.")


def field_names() -> list[str]:
    """The names of all config fields, in declaration order."""
    return [f.name for f in dataclasses.fields(TrainConfig)]
