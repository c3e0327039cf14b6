"""Repository hygiene, run by CI through the README's test command (`python -m pytest -q`).

* Every Python file of the repository compiles, including the ones no test imports (scripts, benchmarks,
  tests/sanitizer_driver.py, which once shipped with a line that did not parse and broke scripts/sanitize.sh).
* `ruff check` passes with the [tool.ruff] configuration of pyproject.toml.
* The import graph of the package has no cycle (flash_mla/_geometry.py holds the constants that
  _validation.py and scheduler.py both need).
* The repository describes the product as it is: no file of it narrates how the work was organised (numbered
  sessions or issues, device time budgets); figures cite docs/PERF.md and dates instead.
"""
import re
import ast
import importlib.util
import os
import shutil
import subprocess
import sys
import warnings

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "flash_mla")

# Not ours or not source: version control, build and packaging outputs, caches, virtual environments and the
# vendored CUTLASS submodule.
SKIP_DIRS = {".git", "build", "dist", "third_party", "__pycache__", ".pytest_cache", ".ruff_cache", ".mypy_cache",
             ".tox", ".nox", ".venv", "venv", "node_modules", ".eggs"}


def python_files():
    """Paths (relative to the repository root) of every .py file, and of extensionless scripts whose first line
    runs Python."""
    found = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".egg-info"))
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            if name.endswith(".py") or ("." not in name and _python_shebang(path)):
                found.append(os.path.relpath(path, ROOT))
    return found


def _python_shebang(path):
    try:
        with open(path, "rb") as f:
            first = f.readline(200)
    except OSError:
        return False
    return first.startswith(b"#!") and b"python" in first


def test_walk_finds_the_files_no_test_imports():
    files = set(python_files())
    for expected in ("setup.py", "tests/sanitizer_driver.py", "benchmarks/bench_flash_mla.py",
                     "flash_mla/_geometry.py", "tests/test_repo_hygiene.py"):
        assert expected.replace("/", os.sep) in files, f"{expected} was not found by the walk"
    assert not any(part in SKIP_DIRS for f in files for part in f.split(os.sep)[:-1])


def test_every_python_file_compiles():
    """compile() is what byte-compiling runs, without writing .pyc files into the tree. Warnings are errors:
    an invalid escape sequence in a string is a SyntaxWarning today and a SyntaxError later."""
    failures = []
    for rel in python_files():
        with open(os.path.join(ROOT, rel), "rb") as f:
            source = f.read()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            try:
                compile(source, rel, "exec", dont_inherit=True)
            except (SyntaxError, SyntaxWarning, DeprecationWarning, ValueError) as e:
                where = f"{rel}:{getattr(e, 'lineno', '?')}"
                failures.append(f"{where}: {type(e).__name__}: {e}")
    assert not failures, "files that do not compile:\n" + "\n".join(failures)


def _ruff_command():
    if importlib.util.find_spec("ruff") is not None:
        return [sys.executable, "-m", "ruff"]
    exe = shutil.which("ruff")
    return [exe] if exe else None


def test_ruff_is_clean():
    command = _ruff_command()
    if command is None:
        pytest.skip("ruff is not installed: pip install -e '.[test]' (the test extra pins it), then rerun")
    # --no-cache: leave nothing behind in the checkout; the configuration is pyproject.toml's [tool.ruff]
    result = subprocess.run([*command, "check", "--no-cache", "--output-format", "concise", "."], cwd=ROOT,
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, (f"ruff check found problems (fix them, or justify a `# noqa: CODE` on the "
                                    f"line):\n{result.stdout[-8000:]}{result.stderr[-2000:]}")


def test_ruff_is_configured_and_in_the_test_extra():
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python >= 3.11")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    lint = project["tool"]["ruff"]["lint"]
    assert {"E", "F", "B"} <= set(lint["select"]), lint["select"]
    assert any(req.startswith("ruff") for req in project["project"]["optional-dependencies"]["test"])


def _package_imports(module_path):
    """Names of the flash_mla modules a module imports anywhere in it: a cycle broken only by moving an import into
    a function is still a cycle (and a trap for the next edit)."""
    with open(module_path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), module_path)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:
                names.add(node.module.split(".")[0])
            elif node.level == 1:
                names.update(alias.name for alias in node.names)
            elif node.module and node.module.startswith("flash_mla."):
                names.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            names.update(a.name.split(".")[1] for a in node.names if a.name.startswith("flash_mla."))
    return names


def test_package_import_graph_has_no_cycle():
    modules = {name[:-3] for name in os.listdir(PACKAGE) if name.endswith(".py")}
    graph = {m: _package_imports(os.path.join(PACKAGE, m + ".py")) & modules for m in modules}

    def cycle_from(start, path):
        for nxt in sorted(graph[start]):
            if nxt == path[0]:
                return [*path, nxt]
            if nxt not in path:
                found = cycle_from(nxt, [*path, nxt])
                if found:
                    return found
        return None

    for m in sorted(modules - {"__init__", "__main__"}):
        cycle = cycle_from(m, [m])
        assert cycle is None, "import cycle: " + " -> ".join(cycle)
    # the constants both sides of the old cycle (_validation <-> scheduler) need live in a leaf module
    assert graph["_geometry"] == set(), "_geometry must import nothing from the package"
    assert "_geometry" in graph["_validation"] and "_geometry" in graph["scheduler"]


# What narrating the work looks like; assembled from pieces so that this file does not match itself.
_NARRATION = re.compile("|".join([
    r"\b[Ss]" + r"essions? \d+",                 # numbered work sessions
    r"\b[Ii]" + r"ssues? #?\d+",                  # issue numbers
    r"\bdevice[- ]" + r"minutes?\b",              # device time budgets
    r"\bwork " + r"periods?\b",
]))
_NARRATION_ROOTS = ("README.md", "docs/", "csrc/", "flash_mla/", "tests/", "benchmarks/", "scripts/")


def _tracked_text_files():
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        files = out.splitlines()
    except (OSError, subprocess.CalledProcessError):
        files = []
        for dirpath, dirnames, filenames in os.walk(ROOT):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
            files += [os.path.relpath(os.path.join(dirpath, n), ROOT).replace(os.sep, "/") for n in filenames]
    return [f for f in files if f.startswith(_NARRATION_ROOTS) and os.path.isfile(os.path.join(ROOT, f))]


def test_no_file_narrates_how_the_work_was_organised():
    hits = []
    for rel in _tracked_text_files():
        try:
            with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
                lines = f.readlines()
        except (UnicodeDecodeError, OSError):
            continue                                  # binary files
        hits += [f"{rel}:{i}: {line.strip()[:100]}" for i, line in enumerate(lines, 1) if _NARRATION.search(line)]
    assert not hits, "lines that narrate the work instead of describing the product:\n" + "\n".join(hits)


def test_narration_pattern_catches_what_it_should():
    for bad in ("measured in s" + "ession 9", "I" + "ssue #12 item 4", "30 device-" + "minutes", "w" + "ork period 3"):
        assert _NARRATION.search(bad), bad
    for good in ("pytest's session fixture", "the issues of a serving engine", "a 30-minute run", "period 3"):
        assert not _NARRATION.search(good), good
