"""The worker reaches the database through one object, `jobs.worker.db.ShardStore`: no other
module of `jobs/worker/` makes an ORM query or a retried database call of its own, so every
call it makes is fenced by the attempt and retried across a dropped connection in one place."""

from __future__ import annotations

import ast
from pathlib import Path

import jobs.worker

WORKER = Path(jobs.worker.__file__).parent


def database_calls(path: Path) -> list[str]:
    """`Model.objects` reads and uses of `with_db_retry` in a module, with their lines."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr == "objects":
            found.append(f"{path.name}:{node.lineno}: .objects")
        elif isinstance(node, ast.Name) and node.id == "with_db_retry":
            found.append(f"{path.name}:{node.lineno}: with_db_retry")
        elif isinstance(node, ast.ImportFrom) and any(
                alias.name == "with_db_retry" for alias in node.names):
            found.append(f"{path.name}:{node.lineno}: imports with_db_retry")
    return found


def test_only_the_shard_store_queries_the_database():
    modules = sorted(WORKER.glob("*.py"))
    assert WORKER / "db.py" in modules
    assert [call for path in modules if path.name != "db.py"
            for call in database_calls(path)] == []


def test_the_check_sees_a_query_and_a_retried_call(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("from jobs.worker.db import with_db_retry\n"
                       "from jobs.models import Shard\n\n"
                       "def f():\n"
                       "    return with_db_retry(lambda: Shard.objects.first())\n")
    assert database_calls(planted) == ["planted.py:1: imports with_db_retry",
                                       "planted.py:5: with_db_retry",
                                       "planted.py:5: .objects"]
