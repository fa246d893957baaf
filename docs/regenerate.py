"""Rewrite every part of README.md and docs/ that the tool prints, from the tool.

``uv run python docs/regenerate.py`` rewrites each generated block and docs/configuration.md;
``--check`` rewrites nothing and exits 1, naming each stale page. A generated block is

    <!-- generated: COMMAND -->
    ... (written by this script: COMMAND in a bash block, then its output) ...
    <!-- end generated -->

COMMAND is a command line as a reader types it in the repository root: a ``train.py`` command
(``uv run python train.py``, ``uv run torchrun ... train.py``, ``./run.sh``, with its
environment) or ``uv run python benchmarks/NAME.py ...``, optionally followed by
``| grep -E 'PATTERN'`` (the output's lines that match). ``train.py`` runs in this process
(``train.main``) with the environment torchrun would give rank 0 of the cluster the command
describes (``Command.clusters``); a benchmark script through ``runpy``. Only standard output is
written into the page. tests/test_docs.py fails on a stale block and runs every documented
``train.py`` command's ``--dry-run`` through the same functions.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import runpy
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType
from unittest import mock

REPO = Path(__file__).resolve().parents[1]
PAGES = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))
REGENERATE = "uv run python docs/regenerate.py"
"""The command that rewrites every generated part; the staleness tests print it."""

BLOCK = re.compile(
    r"<!-- generated: (?P<command>.+?) -->\n(?P<body>.*?)<!-- end generated -->", re.DOTALL
)
ASSIGNMENT = re.compile(r"^(?P<name>[A-Z_][A-Z0-9_]*)=(?P<value>.*)$")
LAUNCHER_OPTION = re.compile(r"^--(?P<name>[\w-]+)(?:=(?P<value>.*))?$")
SBATCH_GPUS = re.compile(r"^#SBATCH --gpus-per-node=(\d+)$", re.MULTILINE)
SINGLE_PROCESS = {"WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}
"""What a process started without torchrun sees (whatever the caller's environment holds)."""
COLUMNS = "100"
"""Terminal width for argparse's --help, so generated help text wraps the same everywhere."""


@dataclass(frozen=True)
class Command:
    """One documented command: the program it runs, its arguments, its environment and the
    clusters it plans for (``(nodes, processes per node)``; two for an elastic ``MIN:MAX``)."""

    program: str
    """``train.py`` or ``benchmarks/NAME.py``."""
    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    """The ``NAME=value`` words before the command, as typed."""
    clusters: tuple[tuple[int, int], ...]
    """Empty when no launcher sets the cluster (``python train.py``: the environment's own)."""
    grep: str | None = None

    def environments(self) -> list[dict[str, str]]:
        """The environment rank 0 sees, one per cluster: the typed variables, then what
        torchrun sets (WORLD_SIZE, LOCAL_WORLD_SIZE, RANK, LOCAL_RANK) for a launcher."""
        typed = {**SINGLE_PROCESS, **dict(self.env)}
        if not self.clusters:
            return [typed]
        return [
            {
                **typed,
                "WORLD_SIZE": str(nodes * per_node),
                "LOCAL_WORLD_SIZE": str(per_node),
                "RANK": "0",
                "LOCAL_RANK": "0",
            }
            for nodes, per_node in self.clusters
        ]


def parse_command(line: str) -> Command | None:
    """The ``Command`` of a shell line, or None when it runs neither train.py nor a benchmark
    script. Raises ValueError for a line shlex cannot split."""
    line, _, grep = line.partition(" | grep -E ")
    words = shlex.split(line, comments=True)
    env: list[tuple[str, str]] = []
    while words and (assignment := ASSIGNMENT.match(words[0])):
        env.append((assignment.group("name"), assignment.group("value")))
        words.pop(0)
    for index, word in enumerate(words):
        if word.startswith("benchmarks/") and word.endswith(".py"):
            return Command(word, tuple(words[index + 1 :]), tuple(env), (), grep_pattern(grep))
        if word.endswith("run.sh") and words[index + 1 : index + 2] == ["lighthouse"]:
            return None  # run.sh's lighthouse command runs no train.py (tests/test_launch.py)
        if word.endswith(("train.py", "run.sh", "train.sbatch")):
            clusters = launcher_clusters(word, words[:index], dict(env))
            args = tuple(words[index + 1 :])
            return Command("train.py", args, tuple(env), clusters, grep_pattern(grep))
    return None


def grep_pattern(text: str) -> str | None:
    """The pattern of a ``| grep -E 'PATTERN'`` tail (already split off), or None."""
    return shlex.split(text)[0] if text else None


def launcher_clusters(
    program: str, before: list[str], env: Mapping[str, str]
) -> tuple[tuple[int, int], ...]:
    """``(nodes, processes per node)`` as the launcher starts them: run.sh from NNODES and
    NPROC_PER_NODE, the SLURM script from sbatch's --nodes and its --gpus-per-node, torchrun
    from --nnodes and --nproc-per-node; ``()`` for train.py without a launcher."""
    options = launcher_options(before)
    if program.endswith("run.sh"):
        return node_range(env.get("NNODES", "1"), int(env.get("NPROC_PER_NODE", "1")))
    if program.endswith("train.sbatch"):
        return node_range(options.get("nodes", "1"), sbatch_gpus(program, env))
    if "torchrun" in before or "torch.distributed.run" in before:
        return node_range(options.get("nnodes", "1"), int(options.get("nproc-per-node", "1")))
    return ()


def sbatch_gpus(script: str, env: Mapping[str, str]) -> int:
    """Processes per node under the SLURM script: NPROC_PER_NODE, else its --gpus-per-node."""
    if "NPROC_PER_NODE" in env:
        return int(env["NPROC_PER_NODE"])
    found = SBATCH_GPUS.search((REPO / script).read_text())
    return int(found.group(1)) if found else 1


def launcher_options(words: list[str]) -> dict[str, str]:
    """``--name=value`` options of the launcher words, names with hyphens."""
    options = {}
    for word in words:
        option = LAUNCHER_OPTION.match(word)
        if option and option.group("value") is not None:
            options[option.group("name").replace("_", "-")] = option.group("value")
    return options


def node_range(nodes: str, per_node: int) -> tuple[tuple[int, int], ...]:
    """One cluster for ``N`` nodes, the smallest and the largest for an elastic ``MIN:MAX``."""
    low, _, high = nodes.partition(":")
    return tuple((int(count), per_node) for count in dict.fromkeys((low, high or low)))


@dataclass(frozen=True)
class Result:
    """What a command printed, and its exit status."""

    status: int
    stdout: str
    stderr: str


@cache
def run(program: str, args: tuple[str, ...], env: tuple[tuple[str, str], ...]) -> Result:
    """Run ``program`` with ``args`` in this process, in the repository root, with ``env``
    added to the environment (and restored after); cached, so a page's command and the test
    that checks it share one run."""
    out, err = io.StringIO(), io.StringIO()
    with (
        mock.patch.dict(os.environ, {"COLUMNS": COLUMNS, **dict(env)}),
        contextlib.chdir(REPO),
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
    ):
        status = run_program(program, list(args))
    return Result(status, out.getvalue(), err.getvalue())


def run_program(program: str, args: list[str]) -> int:
    """Exit status of train.py's ``main`` or of a benchmark script's ``__main__``."""
    argv = sys.argv
    sys.argv = [program, *args]
    try:
        if program == "train.py":
            return train_module().main(args)
        runpy.run_path(str(REPO / program), run_name="__main__")
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 1
    finally:
        sys.argv = argv
    return 0


@cache
def train_module() -> ModuleType:
    """train.py imported as a module (its ``main`` parses argv and runs the trainer)."""
    sys.path.insert(0, str(REPO))
    import train  # noqa: PLC0415 - heavy, and only here

    return train


def block_output(command: str) -> str:
    """A generated block's output: the command's standard output (its lines that match the
    grep pattern, if any), with its first cluster's environment. Raises RuntimeError when the
    command fails or is not one this script runs."""
    parsed = parse_command(command)
    if parsed is None:
        raise RuntimeError(f"a generated block runs {command!r}, which is no command I run")
    env = tuple(sorted(parsed.environments()[0].items()))
    result = run(parsed.program, parsed.args, env)
    if result.status != 0:
        raise RuntimeError(f"{command!r} exited {result.status}: {result.stderr[-2000:]}")
    lines = result.stdout.rstrip().splitlines()
    if parsed.grep:
        lines = [line for line in lines if re.search(parsed.grep, line)]
    return "\n".join(line.rstrip() for line in lines)


def render_block(command: str) -> str:
    """The text between a block's markers: the command in a bash block, then its output in a
    text block (not read as commands)."""
    return f"```bash\n{command}\n```\n\n```text\n{block_output(command)}\n```\n"


def generated_commands(text: str) -> list[str]:
    """The commands of a page's generated blocks, in order."""
    return [match.group("command") for match in BLOCK.finditer(text)]


def render_page(text: str) -> str:
    """``text`` with every generated block rewritten."""

    def fill(match: re.Match[str]) -> str:
        command = match.group("command")
        return f"<!-- generated: {command} -->\n{render_block(command)}<!-- end generated -->"

    return BLOCK.sub(fill, text)


def stale_pages() -> dict[Path, str]:
    """Each page whose generated parts differ from the tool's output -> its current rendering;
    docs/configuration.md included."""
    from torchrun_ddp import config_docs  # noqa: PLC0415 - after the path is set up

    pages = {page: render_page(page.read_text()) for page in PAGES}
    pages[REPO / "docs" / "configuration.md"] = config_docs.render()
    return {page: text for page, text in pages.items() if text != page.read_text()}


def main(argv: list[str] | None = None) -> int:
    """Rewrite the stale pages (``--check``: name them and return 1); 0 when all are fresh."""
    parser = argparse.ArgumentParser(prog=REGENERATE, description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="rewrite nothing; exit 1 if stale")
    args = parser.parse_args(argv)
    stale = stale_pages()
    for page, text in stale.items():
        name = page.relative_to(REPO)
        if args.check:
            print(f"stale: {name}")
        else:
            page.write_text(text)
            print(f"rewrote {name}")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
