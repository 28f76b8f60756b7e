"""kernel_bench's Nsight Compute rows: each profiled row gets one plain read of the same host bytes beside it
(ncu_target's read_probe) and its re-read factor net of what ncu counts for such a read. ncu itself is faked
here: its parsing is test_counters'."""

import pytest
import torch
from omegaconf import OmegaConf

import directkv.counters as counters
from experiments import kernel_bench
from experiments.ncu_target import call, host_bytes

KV = host_bytes("prefill", 16384, 1)  # 64 MiB of K and V at a 16K past


def _rows():
    return [{"variant": "tiled", "status": "ok", "kv_bytes": float(KV)},
            {"variant": "naive", "status": "ok", "kv_bytes": float(KV)},
            {"variant": "stream", "status": "ok", "kv_bytes": float(KV)},  # not profiled
            {"variant": "tiled:cg", "status": "error", "kv_bytes": float(KV)}]  # failed: not profiled


def _args(r):
    return ["prefill", r["variant"], "--context", "16384", "--batch", "1", "--q-len", "2048"]


def test_each_profiled_row_gets_the_probe_and_its_net_reread_factor(monkeypatch):
    calls = []
    per_byte = {"tiled": 1.094, "naive": 223.5, "read_probe": 1.09}  # ncu bytes per byte each one reads

    def fake_profile(args):
        calls.append(args)
        return {"ncu_kernels": 1.0, "ncu_pcie_read_bytes": per_byte[args[1]] * KV}

    monkeypatch.setattr(counters, "profile", fake_profile)
    rows = kernel_bench._with_counters(OmegaConf.create({"counters": "ncu"}), _rows(), _args)
    assert [a[1] for a in calls] == ["tiled", "read_probe", "naive"]  # the probe once, with the rows' shape
    assert calls[1][2:] == _args(rows[0])[2:]
    tiled_row, naive, stream, failed = rows
    assert tiled_row["ncu_probe_bytes"] == KV and tiled_row["ncu_probe_pcie_read_bytes"] == pytest.approx(1.09 * KV)
    assert tiled_row["ncu_read_x_probe"] == pytest.approx(1.094 / 1.09)
    assert naive["ncu_read_x_probe"] == pytest.approx(223.5 / 1.09)
    assert "ncu_pcie_read_bytes" not in stream and "ncu_pcie_read_bytes" not in failed


def test_a_failed_probe_leaves_the_rows_counters_and_says_why(monkeypatch):
    def fake_profile(args):
        if args[1] == "read_probe":
            return {"ncu_kernels": 0.0, "ncu_error": "no kernels profiled"}
        return {"ncu_kernels": 1.0, "ncu_pcie_read_bytes": 2.0 * KV}

    monkeypatch.setattr(counters, "profile", fake_profile)
    tiled_row = kernel_bench._with_counters(OmegaConf.create({"counters": "ncu"}), _rows(), _args)[0]
    assert tiled_row["ncu_pcie_read_bytes"] == 2.0 * KV and tiled_row["ncu_probe_error"] == "no kernels profiled"
    assert "ncu_read_x_probe" not in tiled_row


def test_without_ncu_nothing_is_profiled(monkeypatch):
    monkeypatch.setattr(counters, "profile", lambda args: pytest.fail("profiled without counters=ncu"))
    rows = kernel_bench._with_counters(OmegaConf.create({"counters": "none"}), _rows(), _args)
    assert rows == _rows()


def test_host_bytes_is_what_the_rows_count_as_kv():
    assert host_bytes("prefill", 16384, 1) == 67108864  # the prefill rows' kv_bytes at 16K (H200 runs)
    assert host_bytes("gemm", 10240, 1) == 209715200  # B of the 10240^3 GEMM
    assert host_bytes("decode", 4095, 2) == 2 * 2 * 256 * 16 * 8 * 128 * 2  # whole pages: 256 per sequence


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_read_probe_target_runs_on_the_gpu():
    """ncu_target's read_probe call (what ncu profiles) runs over the op's host bytes."""
    from experiments.ncu_target import call

    fn = call("prefill", "read_probe", 1000, 1, 16)
    fn()
    torch.cuda.synchronize()


def test_ncu_target_refuses_gemm_rows_it_cannot_build():
    """Runs without a GPU: a GEMM row is built from its benchmark options, and one whose B is not in pinned host
    memory (or no such row) stops the target before CUDA is touched, instead of profiling the default kernel."""
    for name in ("tiled:b_hbm", "stream:graph", "tiled:nonsense"):
        with pytest.raises(SystemExit, match=f"gemm row '{name}' is not profiled"):
            call("gemm", name, 64, 1, 1)
