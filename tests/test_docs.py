"""The docs stay true: their snippets run, their command lines parse, the API reference is whole.

- Python blocks of Getting started and of every guide: each compiles and its imports run; a
  block preceded by ``<!-- docs-test: ranks=2 -->`` runs whole on 2 gloo ranks
  (:func:`shardwise.testing.run_on_ranks`; the snippet's own ``init_process_group`` is skipped
  by its ``if not dist.is_initialized()`` guard, its ``destroy_process_group`` is a no-op there).
- Shell blocks of every page and the README: each ``shardwise COMMAND`` line (also ``-m
  shardwise``, ``./dev train``) names a real subcommand and only flags that subcommand's
  parser (what ``--help`` prints) has; each ``python -m bench...`` names a real module.
- Every name in ``shardwise.__all__`` has a docstring and a ``::: path`` entry in
  ``docs/reference/api.md`` that resolves to that very object.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import inspect
import re
import shlex
from pathlib import Path

import pytest
import torch.distributed as dist

import shardwise
from shardwise.testing import run_on_ranks

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RUN_MARK = "<!-- docs-test: ranks=2 -->"
TIMEOUT = 60.0

SNIPPET_PAGES = [DOCS / "getting-started.md", *sorted((DOCS / "guides").glob("*.md"))]
ALL_PAGES = sorted(p for p in DOCS.rglob("*.md")) + [ROOT / "README.md", ROOT / "DEVELOPING.md"]


def fenced_blocks(text: str) -> list[tuple[str, str, str, int]]:
    """``(lang, code, marker, line)`` of each top-level fenced block; marker: the line before it."""
    blocks, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        m = re.match(r"^(`{3,})(\w*)", lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(1), m.group(2), i
        j = i + 1
        while j < len(lines) and not lines[j].startswith(fence):
            j += 1
        prev = next((lines[k].strip() for k in range(start - 1, -1, -1) if lines[k].strip()), "")
        blocks.append((lang, "\n".join(lines[start + 1:j]), prev, start + 1))
        i = j + 1
    return blocks


def _cases(pages, lang, marked_only=False):
    out = []
    for page in pages:
        for blang, code, marker, line in fenced_blocks(page.read_text()):
            if blang == lang and (not marked_only or marker == RUN_MARK):
                out.append(pytest.param(code, id=f"{page.relative_to(ROOT)}:{line}"))
    return out


# ---------------------------------------------------------------- Python snippets


def _exec_snippet(code: str) -> None:
    """Run a page's snippet on this rank; the pool's default group stays up."""
    destroy = dist.destroy_process_group
    dist.destroy_process_group = lambda *a, **k: None
    try:
        exec(compile(code, "<docs snippet>", "exec"), {"__name__": "__docs__"})
    finally:
        dist.destroy_process_group = destroy


RUNNABLE = _cases(SNIPPET_PAGES, "python", marked_only=True)


def test_there_are_runnable_snippets():
    assert len(RUNNABLE) >= 2, "Getting started and at least one guide mark a block to run"


@pytest.mark.parametrize("code", RUNNABLE)
def test_marked_snippet_runs_on_two_ranks(code):
    run_on_ranks(_exec_snippet, 2, code, timeout=TIMEOUT)


@pytest.mark.parametrize("code", _cases(SNIPPET_PAGES, "python"))
def test_snippet_compiles_and_its_imports_run(code):
    tree = ast.parse(code)  # a SyntaxError names the line
    imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    exec(compile(ast.Module(body=imports, type_ignores=[]), "<docs imports>", "exec"), {})


# ---------------------------------------------------------------- command lines


def _subparsers():
    from shardwise.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, type(parser._subparsers._group_actions[0])))
    return sub.choices


def _shell_commands(code: str):
    """Each logical line of a shell block as tokens, comments and heredoc bodies dropped."""
    lines, heredoc = [], None
    for raw in code.replace("\\\n", " ").split("\n"):
        if heredoc is not None:
            if raw.strip() == heredoc:
                heredoc = None
            continue
        m = re.search(r"<<-?'?(\w+)'?", raw)
        if m:
            heredoc = m.group(1)
        lines.append(shlex.split(raw, comments=True))
    return lines


def _commands_in(tokens):
    """``(program, subcommand, flags, words)`` for each shardwise / ./dev / bench command in a line
    (``words``: the tokens after the subcommand that are not flags: a nested verb comes first)."""
    out, i = [], 0
    seps = {"|", "||", "&&", ";", "&"}
    while i < len(tokens):
        tok, prev = tokens[i], tokens[i - 1] if i else ""
        program = None
        if tok == "shardwise" and (i == 0 or prev == "-m") or tok.endswith("/shardwise"):
            program = "shardwise"
        elif tok == "./dev":
            program = "dev"
        elif prev == "-m" and tok.startswith("bench"):
            out.append(("bench", tok, [], []))
        if program and i + 1 < len(tokens):
            sub, flags, words, j = tokens[i + 1], [], [], i + 2
            while j < len(tokens) and tokens[j] not in seps:
                if tokens[j].startswith("--"):
                    flags.append(tokens[j].split("=", 1)[0])
                else:
                    words.append(tokens[j])
                j += 1
            out.append((program, sub, flags, words))
            i = j
        i += 1
    return out


@pytest.mark.parametrize("code", [c for p in ALL_PAGES for c in _cases([p], "bash")])
def test_command_lines_match_the_parser(code):
    parsers = _subparsers()
    for tokens in _shell_commands(code):
        for program, sub, flags, words in _commands_in(tokens):
            if program == "bench":
                assert importlib.util.find_spec(sub) is not None, f"no module {sub}"
                continue
            if program == "dev":
                assert sub in {"train", "test", "stress", "docs"}, f"./dev has no command {sub!r}"
                if sub != "train":
                    continue
            assert sub in parsers, f"shardwise has no command {sub!r}"
            parser = parsers[sub]
            verbs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
            if verbs:  # `shardwise data prepare ...`: the verb's flags
                assert words and words[0] in verbs[0].choices, f"`shardwise {sub}` needs one of {sorted(verbs[0].choices)}"
                parser = verbs[0].choices[words[0]]
            known = set(parser._option_string_actions)
            unknown = [f for f in flags if f not in known]
            assert not unknown, f"`shardwise {sub}` has no {unknown} (see `shardwise {sub} --help`)"


def test_every_subcommand_prints_help_into_the_cli_reference():
    page = (DOCS / "reference" / "cli.md").read_text()
    for name, parser in _subparsers().items():
        assert parser.format_help().startswith(f"usage: shardwise {name}")
        assert f"<!-- cli-help: {name} -->" in page, f"docs/reference/cli.md lacks `shardwise {name} --help`"


# ---------------------------------------------------------------- API reference


def _resolve(path: str):
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(path)


def test_every_public_name_has_a_docstring_and_a_reference_entry():
    text = (DOCS / "reference" / "api.md").read_text()
    documented = [_resolve(m) for m in re.findall(r"^::: (\S+)", text, flags=re.M)]
    for name in shardwise.__all__:
        obj = getattr(shardwise, name)
        assert (inspect.getdoc(obj) or "").strip(), f"shardwise.{name} has no docstring"
        assert any(d is obj for d in documented), f"shardwise.{name} is missing from docs/reference/api.md"


def test_readme_is_a_front_page():
    text = (ROOT / "README.md").read_text()
    assert text.startswith("```bash\n./dev train "), "the README starts with the two commands"
    assert len(text.split("\n")) <= 160
