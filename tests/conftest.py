"""Shared test setup.

* A source checkout that was not pip-installed is put on sys.path; an installed flash_mla (which may carry the
  compiled CUDA extension) is left alone.
* `one_torch_thread`: an opt-in fixture for modules that run the CPU backend.
"""
import importlib.util
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
