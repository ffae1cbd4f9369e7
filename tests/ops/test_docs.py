"""The README and docs say what the service does: every setting read from the environment
is in docs/operations.md's table, and the README's Python snippets import what they use."""

from __future__ import annotations

import ast
import builtins
import re
from pathlib import Path

from tests.factories import ROOT

# A read of an environment variable by name: the settings' env_bool/env_int/env_float/
# env_list, os.environ.get / os.getenv, or os.environ[...] (and the `env`/`environ`
# mappings the engine and gpuworkers are given, os.environ by default), but not a write.
READ = re.compile(
    r"""(?:\benv_(?:bool|int|float|list)|\benviron\.get|\bgetenv|\benv\.get)\(\s*"""
    r"""["']([A-Z][A-Z0-9_]+)["']"""
    r"""|\b(?:environ|env)\[\s*["']([A-Z][A-Z0-9_]+)["']\s*\](?!\s*=[^=])""")
# A WSGI request's environ (jobs.http.polls reads it by the same names): not settings.
CGI = {"REQUEST_METHOD", "SCRIPT_NAME", "PATH_INFO", "QUERY_STRING", "CONTENT_TYPE",
       "CONTENT_LENGTH", "SERVER_NAME", "SERVER_PORT", "SERVER_PROTOCOL", "REMOTE_ADDR"}


def settings_read() -> dict[str, set[str]]:
    """Each variable read from the environment in batchweb/, jobs/ and engine/, with the
    files that read it."""
    found: dict[str, set[str]] = {}
    for package in ("batchweb", "jobs", "engine"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for match in READ.finditer(path.read_text()):
                name = match.group(1) or match.group(2)
                if name not in CGI and not name.startswith("HTTP_"):
                    found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def documented() -> set[str]:
    """The names in the first column of docs/operations.md's table of variables. A cell
    may shorten the names after its first: `BATCHWEB_MAX_LORA_RANK`, `_MAX_LORAS` is
    BATCHWEB_MAX_LORAS (the shortened name follows some leading part of the first)."""
    text = (ROOT / "docs" / "operations.md").read_text()
    start = text.index("| variable | default | meaning |")
    rows = text[start:text.index("\n\n", start)].splitlines()[2:]
    names: set[str] = set()
    for row in rows:
        cell = row.split("|")[1]
        tokens = re.findall(r"`([A-Z_][A-Z0-9_<>]*)`", cell)
        full = [t for t in tokens if not t.startswith("_")]
        for token in tokens:
            if not token.startswith("_"):
                names.add(token)
                continue
            for name in full:
                names.update(name[:i] + token for i, c in enumerate(name) if c == "_")
    return names


def test_the_settings_finder_sees_each_way_of_reading() -> None:
    found = settings_read()
    # One of each: env_int, os.environ.get, a read spread over lines, the engine's `env`
    # mapping, gpuworkers' `environ[...]`, a management command's default.
    for name in ("BATCHWEB_HEARTBEAT_SECONDS", "BATCHWEB_VAR_DIR",
                 "BATCHWEB_DB_DEAD_CLIENT_SECONDS", "BATCHWEB_ENGINE_MODE",
                 "CUDA_VISIBLE_DEVICES", "BATCHWEB_BIND"):
        assert name in found, name
    # Writes are not reads (the engine sets vLLM's variables).
    assert "VLLM_MEDIA_URL_ALLOW_REDIRECTS" not in found and "REDIS_URL" in found


def test_every_setting_read_from_the_environment_is_in_the_operations_table() -> None:
    table = documented()
    missing = {name: sorted(files) for name, files in settings_read().items()
               if name not in table}
    assert missing == {}, ("add these to docs/operations.md's table of variables "
                           f"(Running on real infrastructure): {missing}")


def python_snippets(path: Path) -> list[tuple[int, str]]:
    """The ```python blocks of a Markdown file, each with the line it starts on."""
    lines = path.read_text().splitlines()
    snippets: list[tuple[int, str]] = []
    start: int | None = None
    for number, line in enumerate(lines, 1):
        if start is None and line.strip() == "```python":
            start = number
        elif start is not None and line.strip() == "```":
            snippets.append((start + 1, "\n".join(lines[start:number - 1])))
            start = None
    return snippets


def undefined_names(tree: ast.Module) -> set[str]:
    """Names a snippet reads that it neither imports, assigns, defines nor gets from
    Python's builtins."""
    bound = set(dir(builtins))
    read: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return read - bound


def test_the_readme_python_snippets_import_what_they_use() -> None:
    """Each of the README's Python snippets compiles, its imports run, and every name it
    uses comes from an import or the snippet itself (its `time.sleep` needs `import time`)."""
    snippets = python_snippets(ROOT / "README.md")
    assert len(snippets) >= 2
    for line, code in snippets:
        tree = ast.parse(code, filename=f"README.md, line {line}")
        compile(tree, f"README.md, line {line}", "exec")
        imports = ast.Module(body=[node for node in tree.body
                                   if isinstance(node, ast.Import | ast.ImportFrom)],
                             type_ignores=[])
        exec(compile(imports, f"README.md, line {line}", "exec"), {})
        assert undefined_names(tree) == set(), f"README.md, the snippet at line {line}"
