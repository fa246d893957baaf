"""README.md and docs/ stay true to the code.

Checked without training anything: every relative link and image resolves (and
its #anchor, where it names one, is a heading of the target page); every `--flag` of a shown
command exists in that program's parser (train.py through run.sh, sbatch or torchrun, torchrun
itself, the benchmark scripts, ``python -m torchrun_ddp.plot`` / ``.config_docs``), and every bare
`--flag` in inline code exists in one of them; every repository path named in inline code
exists; every config file the docs name parses with the project's own loaders;
docs/configuration.md and every ``<!-- generated: COMMAND -->`` block are what
docs/regenerate.py writes now; and every ``train.py`` command shown (through ``python``,
``torchrun``, run.sh or sbatch, with the cluster its variables describe) passes ``--dry-run``
and fits the GPUs its comment names. The dry runs run in this process (``regenerate.run``,
cached per command), about a minute on 2 quiet cores, most of it counting the bundled data's
tokens for each tiny-config command.

Parsers are built in this process, never by spawning the scripts: train.py's comes from
``config_io.build_parser``; a script's is captured at its first ``parse_args`` call, which is made
to raise before anything else runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import runpy
import shlex
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType

import pytest
from torch.distributed.run import get_args_parser

from torchrun_ddp import config_docs, plot
from torchrun_ddp.config import field_names
from torchrun_ddp.config_io import build_parser, parse_config
from torchrun_ddp.errors import UserError
from torchrun_ddp.model import load_model_config

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PAGE_IDS = [str(page.relative_to(REPO)) for page in PAGES]

FENCE = re.compile(r"^```(?P<lang>[\w-]*)\s*$")
INLINE_CODE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?(?P<target>[^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HTML_IMAGE = re.compile(r"<img\b[^>]*\bsrc=\"(?P<target>[^\"]+)\"")
HEADING = re.compile(r"^(#{1,6})\s+(?P<title>.+?)\s*#*\s*$")
SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)
CONFIG_PATH = re.compile(r"(?<![\w/.-])configs/[\w./-]*\w")
REPO_PATH = re.compile(r"^(?:\./)?(?P<path>(?:benchmarks|configs|data|docs|src|tests)/[\w./-]+)$")
BENCHMARK = re.compile(r"(?:^|/)(?P<script>benchmarks/\w+\.py)$")
SHELL_LANGS = {"", "bash", "sh", "shell", "console"}
SEPARATORS = {"&&", "||", ";", "|"}
EXTERNAL = {"sbatch", "srun", "pytest", "tensorboard", "hf", "pip", "git", "uv sync"}
"""Programs whose flags are their own business (flags after them are not checked)."""
MODULES = {"torchrun_ddp.plot": "plot", "torchrun_ddp.config_docs": "config_docs"}


def _load_regenerate() -> ModuleType:
    """docs/regenerate.py as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("regenerate", REPO / "docs" / "regenerate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["regenerate"] = module  # dataclasses look their module up while defined
    spec.loader.exec_module(module)
    return module


regenerate = _load_regenerate()


# --- Markdown -------------------------------------------------------------------------------


def split_fences(text: str) -> tuple[str, list[tuple[str, str]]]:
    """The page's prose (fenced blocks blanked, line numbers kept) and its fenced blocks as
    (info string, content)."""
    prose: list[str] = []
    blocks: list[tuple[str, str]] = []
    lang: str | None = None
    body: list[str] = []
    for line in text.splitlines():
        fence = FENCE.match(line.strip())
        if lang is None and fence:
            lang, body = fence.group("lang"), []
        elif lang is not None and line.strip() == "```":
            blocks.append((lang, "\n".join(body)))
            lang = None
        elif lang is not None:
            body.append(line)
        prose.append("" if lang is not None or fence or line.strip() == "```" else line)
    return "\n".join(prose), blocks


def slug(title: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    """The #anchors of ``page``'s headings (repeated titles get -1, -2, ... as on GitHub)."""
    prose, _ = split_fences(page.read_text())
    seen: dict[str, int] = {}
    found: set[str] = set()
    for line in prose.splitlines():
        heading = HEADING.match(line)
        if not heading:
            continue
        base = slug(heading.group("title"))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return frozenset(found)


def link_targets(page: Path) -> list[str]:
    """Targets of the page's Markdown links, images and <img> tags, outside code."""
    prose, _ = split_fences(page.read_text())
    prose = INLINE_CODE.sub("", prose)
    return [m.group("target") for pattern in (LINK, HTML_IMAGE) for m in pattern.finditer(prose)]


def inline_code(page: Path) -> list[str]:
    """The page's inline code spans, outside fenced blocks."""
    prose, _ = split_fences(page.read_text())
    return INLINE_CODE.findall(prose)


# --- commands and parsers -------------------------------------------------------------------


def segments(line: str) -> Iterator[list[str]]:
    """Shell words of ``line`` (comments dropped), split into simple commands at && || ; |."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        words = line.split()
    command: list[str] = []
    for word in words:
        if word in SEPARATORS:
            yield command
            command = []
        else:
            command.append(word)
    yield command


def program_of(word: str, previous: str) -> str | None:
    """The program a shell word starts, or None: ``train.py`` (also for run.sh and the SLURM
    script, which pass their arguments on), ``torchrun``, ``benchmarks/X.py``, a module run
    with -m, or an external program."""
    if word.endswith(("train.py", "run.sh", "train.sbatch")):
        return "train.py"
    if word == "torchrun" or (previous == "-m" and word == "torch.distributed.run"):
        return "torchrun"
    if previous == "-m" and word in MODULES:
        return MODULES[word]
    benchmark = BENCHMARK.search(word)
    if benchmark:
        return benchmark.group("script")
    if word in EXTERNAL or f"{previous} {word}" in EXTERNAL:
        return "external"
    return None


def flags_by_program(command: list[str]) -> Iterator[tuple[str | None, str]]:
    """(program, --flag) for each flag of a simple command; the program is the last one named
    before the flag (None before any)."""
    program: str | None = None
    previous = ""
    for word in command:
        program = program_of(word, previous) or program
        if previous == "--train-flags":  # a benchmark's train.py flags, in one quoted word
            yield from flags_by_program(["train.py", *shlex.split(word)])
        elif word.startswith("--") and len(word) > 2:
            yield program, word.split("=", 1)[0]
        previous = word


def shown_commands(page: Path) -> Iterator[list[str]]:
    """Simple commands of the page's shell blocks and of its inline code spans."""
    _, blocks = split_fences(page.read_text())
    for lang, body in blocks:
        if lang in SHELL_LANGS:
            for line in body.replace("\\\n", " ").splitlines():
                yield from segments(line)
    for span in inline_code(page):
        yield from segments(span)


class _Parsed(Exception):  # noqa: N818 - a control-flow signal, not an error
    """Raised from a patched ``parse_args`` to hand the parser back."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__("parser captured")
        self.parser = parser


def captured_parser(call: Callable[[], object]) -> argparse.ArgumentParser:
    """The parser that ``call`` builds, taken at its first parse; nothing after that runs."""

    def capture(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        raise _Parsed(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_known_args", capture)
        patch.setattr(argparse.ArgumentParser, "parse_args", capture)
        patch.setattr(sys, "path", list(sys.path))
        try:
            call()
        except _Parsed as parsed:
            return parsed.parser
    raise AssertionError("no argument parser was used")


def _run_script(path: Path) -> Callable[[], object]:
    def run() -> object:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(sys, "argv", [str(path)])
            return runpy.run_path(str(path), run_name="__main__")

    return run


def _parser(program: str) -> argparse.ArgumentParser:
    if program == "train.py":
        return build_parser()
    if program == "torchrun":
        return get_args_parser()
    if program == "plot":
        return captured_parser(lambda: plot.main([]))
    if program == "config_docs":
        return captured_parser(lambda: config_docs.main([]))
    script = REPO / program
    assert script.is_file(), f"the docs run {program}, which does not exist"
    return captured_parser(_run_script(script))


@cache
def known_flags(program: str) -> frozenset[str]:
    """Every option string ``program``'s parser accepts."""
    return frozenset(flag for action in _parser(program)._actions for flag in action.option_strings)


@cache
def all_known_flags() -> frozenset[str]:
    """Flags of every program the docs may name (for bare flags in inline code)."""
    programs = ["train.py", "torchrun", "plot", "config_docs"]
    programs += [f"benchmarks/{p.name}" for p in sorted((REPO / "benchmarks").glob("*.py"))]
    programs.remove("benchmarks/common.py")
    return frozenset().union(*(known_flags(program) for program in programs))


def unknown_flags(page: Path) -> list[str]:
    """'program --flag' for each flag of the page's commands that its program does not have."""
    unknown = []
    for command in shown_commands(page):
        for program, flag in flags_by_program(command):
            if program == "external":
                continue
            known = all_known_flags() if program is None else known_flags(program)
            if flag not in known:
                unknown.append(f"{program or 'any program'}: {flag} (in {' '.join(command)})")
    return unknown


# --- documented train.py commands and their dry runs ---------------------------------------

DEVICE = re.compile(
    r"\b(?:(?P<nodes>\d+) x )?(?:(?P<gpus>\d+) x |one )(?P<size>\d+) (?P<unit>GiB|GB)\b"
)
"""A device a command's comment names: ``2 x 8 x 80 GiB``, ``8 x 24 GB``, ``one 24 GB``."""
CODE_SPAN = re.compile(r"`(?P<code>[^`]+)`")
"""An inline code span, which may wrap onto the next lines."""
PROGRAMS = ("train.py", "run.sh", "train.sbatch")
PATH_FLAGS = {"--output-dir", "--checkpoint-dir"}


@dataclass(frozen=True)
class Claim:
    """The device a command's comment says it fits: GPUs (nodes x per node) of ``gib``."""

    gpus: int | None
    gib: float


@dataclass(frozen=True)
class DocCommand:
    """A train.py command shown on a page, where, and the device its comment says it fits."""

    page: str
    line: int
    text: str
    command: regenerate.Command
    claim: Claim | None

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def claim_of(comment: str) -> Claim | None:
    """The device ``comment`` names (the last one), None where it names none or says the
    command does not fit. GB are decimal (24 GB = 22.35 GiB), GiB binary."""
    devices = list(DEVICE.finditer(comment))
    if not devices or "not fit" in comment:
        return None
    device = devices[-1]
    size = float(device.group("size"))
    gib = size if device.group("unit") == "GiB" else round(size * 1e9 / 2**30, 2)
    gpus = int(device.group("gpus") or 1) * int(device.group("nodes") or 1)
    return Claim(gpus, gib)


def block_lines(body: str, first: int) -> Iterator[tuple[int, str, str]]:
    """(line number, logical line, the comment lines just above it and its own comment) of a
    shell block's lines; a line ending in a backslash continues on the next."""
    comments: list[str] = []
    logical, start = "", first
    for number, raw in enumerate(body.splitlines(), start=first):
        stripped = raw.strip()
        if not logical and stripped.startswith("#"):
            comments.append(stripped)
            continue
        logical, start = (logical + " " + stripped, start) if logical else (stripped, number)
        if logical.endswith("\\"):
            logical = logical[:-1]
            continue
        own = logical.partition(" #")[2]
        yield start, logical, " ".join([*comments, own])
        comments, logical = [], ""


def shell_blocks(text: str) -> Iterator[tuple[int, str]]:
    """(number of the first body line, body) of each fenced shell block of ``text``."""
    lang: str | None = None
    body: list[str] = []
    first = 0
    for number, line in enumerate(text.splitlines(), start=1):
        fence = FENCE.match(line.strip())
        if lang is None and fence:
            lang, body, first = fence.group("lang"), [], number + 1
        elif lang is not None and line.strip() == "```":
            if lang in SHELL_LANGS:
                yield first, "\n".join(body)
            lang = None
        elif lang is not None:
            body.append(line)


def page_commands(page: Path) -> list[DocCommand]:
    """The train.py commands of a page: its shell blocks' lines (the comment's device as a
    claim) and its inline code spans (no claim)."""
    name = str(page.relative_to(REPO))
    text = page.read_text()
    found = []
    for first, body in shell_blocks(text):
        for line, logical, comment in block_lines(body, first):
            if not any(program in logical for program in PROGRAMS):
                continue
            command = regenerate.parse_command(logical)
            if command and command.program == "train.py":
                found.append(DocCommand(name, line, logical, command, claim_of(comment)))
    prose, _ = split_fences(text)
    for match in CODE_SPAN.finditer(prose):
        code = " ".join(match.group("code").split())
        if not any(program in code for program in PROGRAMS):
            continue
        command = regenerate.parse_command(code)
        if command and command.program == "train.py":
            line = prose.count("\n", 0, match.start()) + 1
            found.append(DocCommand(name, line, code, command, None))
    return found


DOC_COMMANDS = [command for page in PAGES for command in page_commands(page)]


def leaves_repository(doc: DocCommand) -> bool:
    """The command reads files beside the repository (the developers' larger data set), which
    only benchmarks may read."""
    return any(arg.startswith("..") for arg in doc.command.args)


def dry_run_args(doc: DocCommand, root: Path) -> tuple[str, ...]:
    """The command's arguments with --dry-run, absolute output or checkpoint folders moved under
    ``root`` (the reader's paths, not this machine's), and the memory of the device the comment
    names in place of the command's own --device-memory-gib (a 24 GB card as 22.35 GiB)."""
    args = list(doc.command.args)
    for index, arg in enumerate(args[:-1]):
        if arg in PATH_FLAGS and args[index + 1].startswith("/"):
            args[index + 1] = str(root / args[index + 1].lstrip("/"))
    if "--dry-run" not in args:
        args.append("--dry-run")
    if doc.claim is None:
        return tuple(args)
    if "--device-memory-gib" in args:  # checked at the size the comment names
        del args[args.index("--device-memory-gib") : args.index("--device-memory-gib") + 2]
    return (*args, "--device-memory-gib", f"{doc.claim.gib:g}")


def check_claim(doc: DocCommand, args: tuple[str, ...], plan: str) -> None:
    """The plan says the command fits the device its comment names, on as many GPUs."""
    assert doc.claim is not None
    memory = float(args[args.index("--device-memory-gib") + 1])
    assert memory == doc.claim.gib, f"{doc.id}: the comment names {doc.claim.gib} GiB"
    plan_line = next(line for line in plan.splitlines() if line.startswith("plan per rank:"))
    assert f"x {memory:g} GiB" in plan_line, plan_line
    if doc.claim.gpus and doc.claim.gpus > 1 and len(doc.command.environments()) == 1:
        assert f" {doc.claim.gpus} x {memory:g} GiB" in plan_line, f"{doc.id}: {plan_line}"
    verdict = next(line for line in plan.splitlines() if line.startswith("| verdict |"))
    assert "| fits" in verdict, f"{doc.id}: {doc.text}\n{plan}"


# --- tests ----------------------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_links_and_images_resolve(page: Path) -> None:
    broken = []
    for target in link_targets(page):
        if SCHEME.match(target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading with anchor #{anchor}")
    assert not broken, f"{page.relative_to(REPO)}: broken links: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_flags_of_shown_commands_exist(page: Path) -> None:
    unknown = unknown_flags(page)
    assert not unknown, f"{page.relative_to(REPO)}: flags that do not exist: {unknown}"


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_repository_paths_in_inline_code_exist(page: Path) -> None:
    named = [m.group("path") for span in inline_code(page) if (m := REPO_PATH.match(span))]
    missing = [path for path in named if "*" not in path and not (REPO / path).exists()]
    assert not missing, f"{page.relative_to(REPO)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_named_config_files_parse(page: Path) -> None:
    for name in sorted(set(CONFIG_PATH.findall(page.read_text()))):
        path = REPO / name
        assert path.exists(), f"{page.relative_to(REPO)} names {name}, which does not exist"
        if path.suffix == ".toml":
            config = parse_config(["--config", str(path)])
            assert config.seq_length > 0, name
        elif path.suffix == ".json":
            assert load_model_config(str(path)).model_type, name


def test_the_checks_catch_what_they_are_for(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n[ok](#title) [gone](missing.md) [bad anchor](#nowhere)\n"
        "```bash\nuv run python train.py --seq-length 8 --no-such-flag 1\n"
        "uv run python benchmarks/memory.py --plans --warp 9\n"
        "uv run python benchmarks/sites_goodput.py --train-flags '--compression dct --nope 1'"
        "\n```\n"
        "Try `--zero1` or `--not-a-flag`; `sbatch --anything examples/slurm/train.sbatch`.\n"
    )
    assert link_targets(page) == ["#title", "missing.md", "#nowhere"]
    assert anchors(page) == {"title"}
    assert unknown_flags(page) == [
        "train.py: --no-such-flag (in uv run python train.py --seq-length 8 --no-such-flag 1)",
        "benchmarks/memory.py: --warp (in uv run python benchmarks/memory.py --plans --warp 9)",
        "train.py: --nope (in uv run python benchmarks/sites_goodput.py --train-flags "
        "--compression dct --nope 1)",
        "any program: --not-a-flag (in --not-a-flag)",
    ]


def test_slug_follows_github() -> None:
    assert slug("DeMo (`--optimizer demo`)") == "demo---optimizer-demo"
    assert slug("metrics.jsonl") == "metricsjsonl"
    assert slug("Rotating vs low-pass `dct` at 8x") == "rotating-vs-low-pass-dct-at-8x"


def test_readme_shows_the_main_commands_on_its_first_screen() -> None:
    lines = (REPO / "README.md").read_text().splitlines()
    first_screen = "\n".join(lines[:60])
    for command in (
        "--nproc_per_node=2 train.py --config configs/tiny.toml",  # quick start
        "uv run python train.py --config",  # one GPU
        "NPROC_PER_NODE=8 ./run.sh --config configs/llama2_7b.toml",  # 8 GPUs, 7B full
        "configs/llama2_7b_lora.toml",  # 7B LoRA
        "NODE_RANK=0",  # multi-node with run.sh
        "sbatch",  # SLURM
        "configs/llama2_7b_cross_site.toml",  # slow link: hsdp + dct
        "--optimizer sparseloco",  # slow link
        "--optimizer demo",  # slow link
        "NNODES=1:4",  # elastic
        'pytest -q -m "not slow"',  # fast tier
        "pytest -q -n 2 --dist loadfile",  # the full suite, as .ci/run runs it
    ):
        assert command in first_screen, f"README's first 60 lines lack {command!r}"


def test_configuration_page_is_generated_from_the_code() -> None:
    page = (REPO / "docs" / "configuration.md").read_text()
    assert page == config_docs.render(), (
        f"docs/configuration.md is stale; regenerate it with: {config_docs.REGENERATE}"
    )


def test_configuration_page_lists_every_option_in_a_section(tmp_path: Path) -> None:
    assert set(config_docs.sections()) == set(field_names()), "a field outside the source scan"
    out = tmp_path / "configuration.md"
    assert config_docs.main(["--out", str(out)]) == 0
    spans = set(INLINE_CODE.findall(out.read_text()))
    for action in build_parser()._actions:
        hyphenated = [flag for flag in action.option_strings if "_" not in flag]
        for flag in hyphenated:
            if flag not in {"-h", "--help"}:
                assert flag in spans, f"{flag} is missing from the configuration page"


@pytest.fixture(scope="session")
def reader_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where a command's absolute output and checkpoint folders are planned."""
    return tmp_path_factory.mktemp("reader-root")


@pytest.mark.parametrize("doc", DOC_COMMANDS, ids=[doc.id for doc in DOC_COMMANDS])
def test_documented_command_dry_runs(doc: DocCommand, reader_root: Path) -> None:
    """Every train.py command of README.md and docs/ dry-runs with status 0, at the cluster it
    describes (each end of an elastic range), and fits the device its comment names."""
    if leaves_repository(doc):
        pytest.skip("reads the data beside the repository, which only benchmarks read")
    args = dry_run_args(doc, reader_root)
    for env in doc.command.environments():
        result = regenerate.run("train.py", args, tuple(sorted(env.items())))
        assert result.status == 0, f"{doc.id}: {doc.text}\n{result.stderr[-3000:]}"
        if doc.claim:
            check_claim(doc, args, result.stdout)


def test_generated_parts_are_what_the_tool_prints_now() -> None:
    """Every ``<!-- generated: COMMAND -->`` block of README.md and docs/ holds COMMAND's
    output of this checkout (and docs/configuration.md the configuration page), so no pasted
    plan or help text drifts from the tool."""
    stale = [str(page.relative_to(REPO)) for page in regenerate.stale_pages()]
    assert not stale, f"stale generated parts in {stale}: run `{regenerate.REGENERATE}`"


def test_generated_blocks_are_checked_as_commands() -> None:
    """The pages carry generated blocks, and each block's command is one of the documented
    commands that test_documented_command_dry_runs runs (a block cannot hide a command)."""
    commands = {doc.text for doc in DOC_COMMANDS}
    blocks = [c for page in PAGES for c in regenerate.generated_commands(page.read_text())]
    assert len(blocks) >= 3, blocks
    for command in blocks:
        assert command in commands, command


def test_a_method_that_ddp_cannot_fit_is_pointed_at_the_mode_that_takes_it() -> None:
    """SparseLoCo on 7B does not fit 80 GiB under DDP; the hint names hsdp for it (fsdp
    refuses the method), and hsdp then fits (README's 2 x 8 x 80 GiB command)."""
    env = tuple(sorted({**regenerate.SINGLE_PROCESS, "WORLD_SIZE": "16",
                        "LOCAL_WORLD_SIZE": "8"}.items()))  # fmt: skip
    base = ("--config", "configs/llama2_7b.toml", "--optimizer", "sparseloco", "--dry-run")
    ddp = regenerate.run("train.py", (*base, "--device-memory-gib", "80"), env)
    assert ddp.status == 0 and "does not fit" in ddp.stdout, ddp.stderr
    hint = next(line for line in ddp.stdout.splitlines() if "no combination fits" in line)
    assert "hsdp for a --compression hook or --optimizer demo, diloco, sparseloco" in hint, hint
    hsdp = regenerate.run("train.py", (*base, "--data-parallel", "hsdp"), env)
    assert "| verdict | fits" in hsdp.stdout, hsdp.stdout[-2000:]


@pytest.mark.parametrize("mode", ["ddp", "fsdp", "hsdp"])
def test_the_7b_config_carries_nothing_a_mode_or_method_refuses(mode: str) -> None:
    """configs/llama2_7b.toml parses (every refusal of config_checks and the modes included)
    under each --data-parallel mode with each --optimizer the mode accepts at all, so a
    command adds its mode and method and undoes nothing; the DDP config with ZeRO-1 and a hook
    is refused by the sharded modes, as its comment says."""
    config = str(REPO / "configs" / "llama2_7b.toml")
    methods = ["adamw"] if mode == "fsdp" else ["adamw", "demo", "diloco", "sparseloco", "muloco"]
    for method in methods:
        run = parse_config(["--config", config, "--data-parallel", mode, "--optimizer", method])
        assert (run.data_parallel, run.optimizer) == (mode, method)
        assert not run.zero1 and run.compression == "none"
    if mode != "ddp":
        with pytest.raises(UserError, match="--zero1"):
            parse_config(["--config", str(REPO / "configs" / "llama2_7b_ddp_dct.toml"),
                          "--data-parallel", mode])  # fmt: skip
