"""`python -m flash_mla`: the end-to-end check on the CPU, in a subprocess and in-process."""
import os
import subprocess
import sys

import pytest
import torch

import flash_mla
import flash_mla.__main__ as cli
from flash_mla.backends import ENV_VAR

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(flash_mla.__file__)))
pytestmark = pytest.mark.usefixtures("one_torch_thread")
SMALL = ["--device", "cpu", "--batch", "3", "--seqlen", "200", "--heads", "16", "--seqlen-q", "2", "--runs", "1"]


def run_cli(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    env.pop(ENV_VAR, None)
    return subprocess.run([sys.executable, "-m", "flash_mla", *args], capture_output=True, text=True, env=env,
                          timeout=120)


def test_cli_cpu_passes():
    proc = run_cli(*SMALL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "backend: cpu" in out
    assert "device: cpu" in out
    assert "q (3, 2, 16, 576)" in out and "out (3, 2, 16, 512)" in out
    assert "median" in out and " ms " in out
    assert "check     PASS" in out


def test_cli_unavailable_backend_fails():
    proc = run_cli("--device", "cpu", "--backend", "cuda", "--batch", "1")
    assert proc.returncode == 2
    assert "backend 'cuda'" in proc.stderr and "unavailable" in proc.stderr


@pytest.fixture(autouse=True)
def _automatic_backend(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)


@pytest.mark.parametrize("extra", [[], ["--dtype", "fp16", "--no-causal", "--kv-heads", "2", "--fixed"]])
def test_cli_in_process(capsys, extra):
    assert cli.main(SMALL + extra) == 0
    out = capsys.readouterr().out
    assert "backend: cpu" in out and "PASS" in out
    if extra:
        assert "fp16" in out and "non-causal" in out and "k_cache" in out and "fixed" in out


def test_cli_fails_on_wrong_result(capsys, monkeypatch):
    """A backend returning a wrong answer makes the check, and the exit status, fail."""
    real = cli.flash_mla_with_kvcache

    def broken(*args, **kwargs):
        out, lse = real(*args, **kwargs)
        return out * 1.5, lse

    monkeypatch.setattr(cli, "flash_mla_with_kvcache", broken)
    assert cli.main(SMALL) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "out error" in out


def test_cli_rejects_bad_options(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--device", "cpu", "--heads", "16", "--kv-heads", "3"])
    assert info.value.code == 2
    assert "--kv-heads" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as info:
            cli.main(["--device", "cuda"])
        assert info.value.code == 2
