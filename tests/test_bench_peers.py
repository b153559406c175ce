"""tools/bench_peers.py without llama.cpp or a real cgroup: its report parsing, its lines, the
memory-cgroup helper on fake v1 and v2 trees, the cold-start eviction, and the MXFP4 K3 slice
it benchmarks (small expert count) opening as the official layout."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mtplx_runtime.checkpoint.reader import open_checkpoint
from mtplx_runtime.fixtures.k3_slice import make_k3_slice

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench_peers.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_peers", TOOL)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_peers"] = mod  # its dataclass looks its module up there
    spec.loader.exec_module(mod)
    return mod


REPORT = {"ids": [5, 7, 9], "load_s": 0.5, "prefill_s": 1.25, "decode_s": 0.5,
          "decode_forwards": 2, "read_load": 100, "read_prefill": 3000, "read_decode": 4000,
          "maxrss_kib": 2048}


def test_parse_report_takes_the_last_json_line(bench):
    out = "log line\n{\"ids\": [1]}\n" + json.dumps(REPORT) + "\n"
    r = bench.parse_report("llama.cpp mmap", 10**9, out)
    assert (r.ids, r.status, r.cap) == ([5, 7, 9], "ok", 10**9)
    assert r.tok_s == pytest.approx(4.0)  # 2 forwards in 0.5 s
    assert r.read_per_token == 2000  # 4000 B over 2 decode forwards
    assert r.maxrss == 2048 * 1024


@pytest.mark.parametrize("stdout, why", [
    ("no json here\n", "no JSON report"),
    (json.dumps({k: v for k, v in REPORT.items() if k != "read_decode"}), "read_decode"),
    (json.dumps({**REPORT, "read_load": -1}), "/proc/self/io"),
])
def test_parse_report_refuses_what_it_cannot_trust(bench, stdout, why):
    with pytest.raises(ValueError, match=why):
        bench.parse_report("mtplx", None, stdout)


def test_agreement_and_lines(bench):
    assert bench.agreement([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert bench.agreement([], [1]) == 0
    r = bench.parse_report("mtplx", 2 * 10**9, json.dumps(REPORT))
    line = bench.run_line(r, [5, 7, 1])
    assert "cap_gb=2.00" in line and "tok_s=4.000" in line and "same_first_ids=2/3" in line
    assert "decode_read_gb_per_tok=0.00" in line and "ids=5,7,9" in line
    oom = bench.Run("llama.cpp no-mmap", None, "oom", [])
    assert bench.run_line(oom, [1]) == "peers cap_gb=none engine='llama.cpp no-mmap' status=oom"


def fake_v1(root: Path) -> Path:
    mem = root / "memory"
    mem.mkdir(parents=True)
    (mem / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    return root


def test_cgroup_v1_on_a_fake_tree(bench, tmp_path):
    root = fake_v1(tmp_path)
    cg = bench.MemoryCgroup("run1", root)
    assert cg.version == 1 and cg.path == root / "memory" / "run1"
    cg.set_limit(123456789)
    assert (cg.path / "memory.limit_in_bytes").read_text() == "123456789"
    assert (cg.path / "memory.max_usage_in_bytes").read_text() == "0"  # peak reset
    (cg.path / "memory.max_usage_in_bytes").write_text("4096\n")
    assert cg.peak() == 4096
    assert cg.oom_kills() == 0  # no oom_control file: none counted
    (cg.path / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    assert cg.oom_kills() == 2
    assert cg.limit_hits() == 0 and cg.kmem_peak() is None  # files absent: none counted
    (cg.path / "memory.failcnt").write_text("3\n")
    (cg.path / "memory.kmem.max_usage_in_bytes").write_text("8192\n")
    assert cg.limit_hits() == 3 and cg.kmem_peak() == 8192
    cg.set_limit(None)
    assert (cg.path / "memory.limit_in_bytes").read_text() == "-1"
    # the child's pre-exec hook writes its own pid into cgroup.procs
    bench.in_cgroup(cg.procs_file())()
    assert (cg.path / "cgroup.procs").read_text() == str(os.getpid())


def test_cgroup_v2_on_a_fake_tree(bench, tmp_path):
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    cg = bench.MemoryCgroup("run2", tmp_path)
    assert cg.version == 2 and cg.path == tmp_path / "run2"
    cg.set_limit(10**9)
    assert (cg.path / "memory.max").read_text() == str(10**9)
    assert not (cg.path / "memory.peak").exists()  # no peak file: nothing written to reset
    (cg.path / "memory.peak").write_text("777\n")
    assert cg.peak() == 777
    (cg.path / "memory.events").write_text("low 0\nhigh 0\nmax 5\noom 1\noom_kill 1\n")
    assert cg.oom_kills() == 1
    assert cg.limit_hits() == 5 and cg.kmem_peak() is None  # v2 keeps no kernel-memory peak
    cg.set_limit(None)
    assert (cg.path / "memory.max").read_text() == "max"


def test_cgroup_refuses_a_tree_without_the_memory_controller(bench, tmp_path):
    with pytest.raises(bench.CgroupError, match="no memory cgroup controller"):
        bench.MemoryCgroup("x", tmp_path)
    (tmp_path / "cgroup.controllers").write_text("cpu io pids\n")
    with pytest.raises(bench.CgroupError, match="without the memory controller"):
        bench.MemoryCgroup("x", tmp_path)


def test_evict_keeps_the_bytes(bench, tmp_path):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"\x01" * 8192)
    bench.evict([f])
    assert f.read_bytes() == b"\x01" * 8192
    assert bench.model_files(tmp_path) == [f]


def test_mxfp4_slice_is_the_official_layout(tmp_path):
    """The slice bench_peers converts: per-expert MXFP4 tensors under the nested config, opened
    as mxfp4 with every E8M0 exponent a number (no 255) and weights of about 1/sqrt(fan_in)."""
    src = make_k3_slice(tmp_path / "src", moe_layers=1, experts=16, top_k=4, codec="mxfp4")
    cfg = json.loads((src / "config.json").read_text())
    assert cfg["text_config"]["quantization_config"]["format"] == "mxfp4-pack-quantized"
    ck = open_checkpoint(src)
    try:
        assert ck.codec.name == "mxfp4"
        rec = ck.expert(1, 15)
        for proj, (rows, cols) in ck.config.expert_shapes.items():
            parts = rec.projections[proj]
            w = parts.decode()
            assert w.shape == (rows, cols) and np.isfinite(w).all()
            assert 0.3 < float(np.std(w)) * cols ** 0.5 < 3
    finally:
        ck.close()
    again = make_k3_slice(tmp_path / "again", moe_layers=1, experts=16, top_k=4, codec="mxfp4")
    assert ((src / "experts-layer-001.safetensors").read_bytes()
            == (again / "experts-layer-001.safetensors").read_bytes())
    with pytest.raises(ValueError, match="codec 'w3' is not one of"):
        make_k3_slice(tmp_path / "bad", codec="w3")


def test_the_tool_refuses_a_machine_without_a_memory_cgroup(tmp_path):
    p = subprocess.run([sys.executable, str(TOOL), "--work", str(tmp_path),
                        "--cgroup-root", str(tmp_path)], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(TOOL.parents[1])))
    assert p.returncode != 0 and "no memory cgroup controller" in p.stderr


def test_caps_take_percentages_and_none(bench):
    assert bench.build_parser().parse_args(["--work", "w"]).caps == [5, 25, 100]
    assert bench.build_parser().parse_args(["--work", "w", "--caps", "100,none"]).caps \
        == [100, None]
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args(["--work", "w", "--caps", "100,all"])
