"""MkDocs hook: pages made from files outside docs/ and from the CLI itself, at build time.

- ``<!-- include: PATH -->`` (PATH relative to the repository root) is replaced by that file,
  with its links rewritten for the site (``docs/x.md`` -> ``x.md`` and the root's Markdown
  files -> their pages), so README.md, ARCHITECTURE.md and DEVELOPING.md are never copied by
  hand.
- Sphinx roles in docstrings (``:class:`X```, ``:func:`~a.b```) render as plain code.
- ``<!-- cli-help: COMMAND -->`` is replaced by ``shardwise COMMAND --help`` (``shardwise
  --help`` for ``<!-- cli-help: shardwise -->``) as a text block,
  taken from this checkout's parser (``shardwise.cli.build_parser``).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INCLUDE = re.compile(r"<!-- include: (\S+) -->")
SPHINX_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):(<code>)~?")
CLI_HELP = re.compile(r"<!-- cli-help: (\S+) -->")
# links from the root's files into the site, as the page that includes them sees them
ROOT_LINKS = {"ARCHITECTURE.md": "architecture.md", "DEVELOPING.md": "developing.md",
              "bench/README.md": "benchmarks.md", "README.md": "index.md"}


def _site_links(text: str) -> str:
    def fix(m: re.Match) -> str:
        target = m.group(1)
        path, _, anchor = target.partition("#")
        if path.startswith("../docs/"):  # from bench/README.md
            path = path[len("../docs/"):]
        elif path.startswith("docs/"):
            path = path[len("docs/"):]
        else:
            path = ROOT_LINKS.get(path, path)
        return "](" + path + ("#" + anchor if anchor else "") + ")"
    return re.sub(r"\]\(((?:docs/|\.\./docs/|ARCHITECTURE\.md|DEVELOPING\.md|bench/README\.md|README\.md)[^)\s]*)\)", fix, text)


def cli_help(command: str) -> str:
    """``shardwise COMMAND --help`` (``shardwise --help`` for "shardwise"; ``data/prepare`` for
    ``shardwise data prepare --help``), 100 columns wide."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    os.environ["COLUMNS"] = "100"
    from shardwise.cli import build_parser

    parser = build_parser()
    if command == "shardwise":
        return parser.format_help()
    for word in command.split("/"):
        sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
        parser = sub.choices[word]
    return parser.format_help()


def on_page_markdown(markdown: str, page, config, files) -> str:
    markdown = INCLUDE.sub(lambda m: _site_links((ROOT / m.group(1)).read_text()), markdown)
    return CLI_HELP.sub(lambda m: "```text\n" + cli_help(m.group(1)).rstrip() + "\n```", markdown)


def on_page_content(html: str, page, config, files) -> str:
    return SPHINX_ROLE.sub(r"\1", html)


def on_post_page(output: str, page, config) -> str:
    """A marker left in a page is a mistake (a misspelt include or command): fail the build."""
    for marker in ("<!-- include:", "<!-- cli-help:"):
        if marker in output:
            raise ValueError(f"{page.file.src_path}: unexpanded {marker} ... --> marker")
    return output
