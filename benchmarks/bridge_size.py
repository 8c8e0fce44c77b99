"""Size of the Megatron bridge: code lines (no blank lines, comments or docstrings) of its engine files, now and at
an earlier commit.

    python benchmarks/bridge_size.py [--before faf8516]

The engine files are those that connect Lightning to Megatron Core's DDP, optimizer, precision and parallel state
(``speechtrain/lightning/``: megatron_parallel, strategy, precision, optimizer, megatron_compat, parallel_state; at
the first round also grad_buckets and grad_norm, which Megatron's engine replaced). A line counts when it holds a
token other than a comment; the lines of a module, class or function docstring do not count.
"""

import argparse
import ast
import io
import subprocess
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ["megatron_parallel", "strategy", "precision", "optimizer", "megatron_compat", "parallel_state",
          "grad_buckets", "grad_norm"]  # fmt: skip


def code_lines(source: str) -> int:
    """Lines holding code: not blank, not only a comment, not part of a docstring."""
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and body:
            first = body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    lines = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in skip:
            lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines - docstrings)


def _source(name: str, commit: str | None) -> str | None:
    path = f"speechtrain/lightning/{name}.py"
    if commit is None:
        file = ROOT / path
        return file.read_text() if file.is_file() else None
    shown = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT, capture_output=True, text=True)
    return shown.stdout if shown.returncode == 0 else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="faf8516", help="the commit to compare with (a git checkout is needed)")
    args = parser.parse_args(argv)
    print(f"| file | {args.before} | now |\n|---|---|---|")
    totals = [0, 0]
    for name in ENGINE:
        counts = [code_lines(s) if s is not None else 0 for s in (_source(name, args.before), _source(name, None))]
        if any(counts):
            print(f"| {name} | {counts[0]} | {counts[1]} |")
            totals = [t + c for t, c in zip(totals, counts)]
    print(f"| **total** | **{totals[0]}** | **{totals[1]}** |")


if __name__ == "__main__":
    main()
