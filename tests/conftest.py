"""Shared test setup.

* A source checkout that was not pip-installed is put on sys.path; an installed flash_mla (which may carry the
  compiled CUDA extension) is left alone.
* `one_torch_thread`: an opt-in fixture for modules that run the CPU backend.
* `default_environment`: the flash_mla environment switches (backend choice, debug checks) unset.
* `nan_empty`: torch.empty hands out NaN-filled floating tensors, so an output element a backend forgets to
  write shows up as NaN.
"""
import importlib.util
import math
import os
import sys

import pytest
import torch

if importlib.util.find_spec("flash_mla") is None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def one_torch_thread():
    """The CPU backend does many small matmuls: with intra-op threads on a busy 2-core CI machine the OpenMP
    barriers dominate (measured 10x slower). Opt in with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def default_environment(monkeypatch):
    """FLASH_MLA_BACKEND and FLASH_MLA_DEBUG unset for the test, whatever the calling shell exported."""
    from flash_mla.backends import ENV_VAR
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.delenv("FLASH_MLA_DEBUG", raising=False)


@pytest.fixture
def nan_empty(monkeypatch):
    """While active, every floating-point tensor from torch.empty starts as NaN (on any device): outputs and
    workspaces the backends allocate are poisoned, so an element that is read before it is written, or never
    written, is caught."""
    real_empty = torch.empty

    def poisoned(*size, **kwargs):
        t = real_empty(*size, **kwargs)
        return t.fill_(math.nan) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)
    yield
    monkeypatch.setattr(torch, "empty", real_empty)
