"""The README's API examples run as written (on CPU tensors: "cuda" becomes "cpu") and give what it says."""
import os
import re

import pytest
import torch

from flash_mla import MLASchedule, mla_decode_reference
from flash_mla.testing import assert_close, compare

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def api_examples():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    section = readme.split("\n## API\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_readme_shows_the_three_call_forms():
    classic, lazy, keywords = api_examples()
    assert "get_mla_metadata(cache_seqlens, s_q * h_q // h_kv, h_kv)" in classic
    assert "get_mla_metadata()" in lazy and "schedule, None" in lazy
    assert all(k in keywords for k in ("num_heads_q=", "is_fp8_kvcache=", "indices=", "attn_sink="))


def test_readme_api_examples_run_on_the_cpu(monkeypatch):
    monkeypatch.delenv("FLASH_MLA_BACKEND", raising=False)
    classic, lazy, keywords = api_examples()
    assert 'device, dtype = "cuda", torch.bfloat16' in classic
    ns = {"num_layers": 2}
    exec(compile(classic.replace('"cuda"', '"cpu"'), "README classic", "exec"), ns)
    out_classic, lse_classic = ns["out"], ns["lse"]
    assert out_classic.shape == (4, 1, 128, 512) and out_classic.dtype == torch.bfloat16
    assert lse_classic.shape == (4, 128, 1) and lse_classic.dtype == torch.float32
    assert (out_classic[2] == 0).all() and torch.isneginf(lse_classic[2]).all()      # the L = 0 sequence

    exec(compile(lazy, "README lazy form", "exec"), ns)
    assert isinstance(ns["schedule"], MLASchedule) and ns["schedule"].have_initialized
    assert torch.equal(ns["out"], out_classic) and torch.equal(ns["lse"], lse_classic)

    exec(compile(keywords, "README keywords", "exec"), ns)
    ref_out, ref_lse = mla_decode_reference(ns["q"], ns["k_cache"], ns["block_table"], ns["cache_seqlens"], 512,
                                            causal=True, attn_sink=ns["attn_sink"])
    assert torch.equal(ns["lse"], lse_classic)                                          # the sink leaves lse alone
    assert_close(compare(ns["out"], ns["lse"], ref_out, ref_lse), torch.bfloat16, "README keywords example")
    assert not torch.equal(ns["out"], out_classic)                                      # the sink did something
