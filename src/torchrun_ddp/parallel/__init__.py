"""Data parallelism as objects: one class per ``--data-parallel`` mode, built once per run.

Modules: ``base`` (the interface every mode answers, the mesh shape), ``ddp`` (DDP: wrapping,
buckets, no-sync), ``fsdp`` (FSDP2: ``fsdp`` and ``hsdp``, units, rank 0's weights scattered,
the full export, the sharded traffic), ``modes`` (the table, ``mode_for``), ``shards`` (what a
DTensor is made of, for the components: a leaf). The trainer carries the mode and asks it; only
this package tests DDP, FSDP or DTensor types.

Imports: ``config``, ``errors``, ``distributed``, ``model``, ``compression`` and the ``plan``
calculators. Imported by the composing modules; the components import ``shards`` alone.
"""
