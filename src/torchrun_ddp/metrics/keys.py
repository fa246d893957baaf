"""What one metrics record holds: its keys and their units, and the ``Record`` type that the
logging window (``window``) and evaluation produce and the sinks (``sinks``) write. Imports
nothing.

Keys and units: ``step`` (optimizer steps done), ``loss`` (mean cross-entropy over ranks, nats
per token), ``lr``, ``tokens_per_s`` (trained tokens per second over all ranks), ``mfu`` (model
FLOPs utilisation, 0..1), ``step_time_s`` and ``data_time_s`` (seconds per step, and the part
spent waiting for data), ``grad_norm`` (global L2 norm before clipping), ``peak_mem_bytes``
(CUDA max allocated, or peak resident set size of the process on CPU), ``comm_bytes`` /
``comm_bytes_dense`` (gradient bytes a rank sends on the wire per step under the ring model, and
what a dense fp32 ring all-reduce at the same world size would send), ``comm_bytes_collective``
(bytes handed to collectives), ``compression_ratio`` (dense / sent; left out of a window that sent
nothing). The byte counts are averages per step over the logging window of what was counted in
the steps that sent it: an optimizer that syncs every H steps (DiLoCo, SparseLoCo) counts its
whole message in the sync step, so at ``--log-every 1`` the other steps read 0, and at a
``--log-every`` that is a multiple of H each record gives the average per step. Evaluation
records carry ``eval_loss`` and ``eval_ppl``, and with --eval-multiple-choice ``mc_accuracy`` and
``mc_accuracy_per_char`` (fractions of questions, each with its ``_stderr``) and
``mc_questions``. Every line of ``metrics.jsonl`` also carries the
``run_id`` of the run that wrote it (the id in the checkpoint folder's ``run.json``).
"""

Record = dict[str, float | int]
"""One metrics record: key -> value, with the keys and units of the module docstring."""
