"""The key-score pass of every key-scored method of the C++ registry (plugins/include/criticalkv/methods/registry.h;
the pass: criticalkv/key_scores.h) run on the CPU: the kernel (plugins/kernels/key_scores.cuh) under the thread
emulation (plugins/testing/cuda_emulation.h: one fiber per CUDA thread) beside the host driver's pass
(plugins/host/select_host.cpp: keyScores), both against the method's PyTorch reference (its ``attention_rows``). The
kernel's scores are the host driver's bit for bit (the same order of fp32 operations, products rounded on their own:
its PTX holds no fused multiply-add); the host driver's are the reference's up to fp32 rounding (the kept entries are
compared in test_plugin_host_select.py). Cases: head dimensions below, at and beyond one warp up to 256 (one thread per
anchor entry), more tokens than threads, left padding, a sequence kept whole, a zero key (unit()'s floor). The registry against the Python methods."""

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from criticalkv import KVPolicy
from criticalkv.methods import BASE_METHODS
from criticalkv.methods.base import BaseMethod
from test_plugin_topk_emulation import PLUGINS, compile_emulator

#: (batch, H_kv, n, d_h, window, budget, lengths)
CASES = [
    (2, 2, 48, 16, 8, 24, [48, 40]),
    (1, 3, 600, 64, 16, 100, [600]),
    (3, 1, 90, 256, 8, 32, [90, 70, 20]),  # the last kept whole
    (1, 2, 33, 8, 32, 32, [33]),  # m = 1
]


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return compile_emulator(tmp_path_factory.mktemp("key_scores"), "key_scores_emulation.cpp")


def run(binary, folder, header, lengths, keys):
    source, target = folder / "in.bin", folder / "out.bin"
    with open(source, "wb") as f:
        f.write(np.asarray(header, np.int32).tobytes())
        f.write(np.asarray(lengths, np.int32).tobytes())
        f.write(keys.numpy().astype(np.float32).tobytes())
    result = subprocess.run([str(binary), str(source), str(target)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    out = np.fromfile(target, np.uint8)
    cells = keys[..., 0].numel()
    step = 4 + 8 * cells
    assert len(out) % step == 0 and len(out) > 0, len(out)
    methods = {}
    for at in range(0, len(out), step):
        base = int(out[at:at + 4].view(np.int32)[0])
        kernel = out[at + 4:at + 4 + 4 * cells].view(np.float32).reshape(keys.shape[:3])
        host = out[at + 4 + 4 * cells:at + step].view(np.float32).reshape(keys.shape[:3])
        methods[base] = (torch.from_numpy(kernel.copy()), torch.from_numpy(host.copy()))
    return methods


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-Hkv{c[1]}-n{c[2]}-d{c[3]}")
def test_the_key_score_kernel_is_the_host_pass_and_the_reference(emulator, tmp_path, case):
    batch, kv_heads, n, d, window, budget, lengths = case
    g = torch.Generator().manual_seed(n * d)
    keys = torch.randn(batch, kv_heads, n, d, generator=g) + 0.7 * torch.randn(1, kv_heads, 1, d, generator=g)
    keys[0, 0, n - 3] = 0.0  # a zero key: unit() divides by the floor 1e-12
    methods = run(emulator, tmp_path, [batch, kv_heads, n, d, window, budget], lengths, keys)
    names = list(BASE_METHODS)
    assert methods and all(0 <= base < len(names) for base in methods), methods.keys()
    m = n - min(window, n)
    valid_start = torch.tensor([n - length for length in lengths], dtype=torch.int64)
    for base, (kernel, host) in methods.items():
        method = BASE_METHODS[names[base]]
        policy = KVPolicy(method.name, budget=budget, window=window)
        queries = torch.zeros(batch, 1, min(window, n), d)
        for b, length in enumerate(lengths):
            start = n - length
            if length <= budget:  # kept whole: neither writes
                assert torch.isnan(kernel[b]).all() and torch.isnan(host[b]).all(), method.name
                continue
            assert torch.equal(kernel[b, :, :m], host[b, :, :m]), (method.name, b)
            assert (host[b, :, :start] == 0).all(), method.name
        for head in range(kv_heads):
            _, raw = method.attention_rows(policy, queries, keys[:, head:head + 1], valid_start, None, m)
            for b, length in enumerate(lengths):
                if length > budget:
                    start = n - length
                    torch.testing.assert_close(host[b, head, start:m], raw[b, 0, start:m].float(), rtol=0, atol=1e-5)


def test_the_registry_holds_the_methods_that_score_their_own_way_on_the_kernels(emulator, tmp_path):
    """A method with its own ``attention_rows`` that the kernels select (``kernels``), and that does not take its scores
    as an input (``external_scores``: kvzip), is in the C++ registry of key-scored methods, and nothing else is: else
    the kernels would rank it by the window's attention."""
    keys = torch.randn(1, 1, 20, 8, generator=torch.Generator().manual_seed(3))
    registered = {list(BASE_METHODS)[base] for base in run(emulator, tmp_path, [1, 1, 20, 8, 4, 8], [20], keys)}
    own = {name for name, method in BASE_METHODS.items()
           if type(method).attention_rows is not BaseMethod.attention_rows and method.kernels
           and not method.external_scores}
    assert registered == own and "keydiff" in registered, (registered, own)


def test_the_key_score_kernels_fuse_no_multiply_add(tmp_path):
    """nvcc fuses a product into a following sum (FMA) unless it is rounded on its own (multiplyRounded); the
    emulation runs with -ffp-contract=off, so a fused kernel would differ from the host driver in the last bit. No
    instance of keyScoresKernel in pipeline.cu's PTX holds an fma.rn.f32."""
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not Path(nvcc).exists():
        pytest.skip("nvcc not found")
    ptx = tmp_path / "pipeline.ptx"
    result = subprocess.run([nvcc, "-std=c++17", "-arch=sm_90", "-ptx", "-O3", f"-I{PLUGINS / 'include'}",
                             f"-I{PLUGINS / 'kernels'}", str(PLUGINS / "kernels" / "pipeline.cu"), "-o", str(ptx)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    entries = re.split(r"(?=\.visible \.entry |\.weak \.entry |\.entry )", ptx.read_text())
    kernels = [e for e in entries if re.match(r"\.(?:visible |weak )?\.?entry\s+\S*keyScoresKernel", e)]
    assert len(kernels) >= 3, len(kernels)  # fp32, fp16, bf16 keys of every registered method
    for entry in kernels:
        assert "fma.rn.f32" not in entry, entry[:200]
