"""Configs compose, every experiment runs on the CPU at small sizes, and bad input gets one line + exit 2."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir

from experiments.run import CONF, group_options, run_experiment

REPO = Path(__file__).resolve().parents[1]
SMALL = {
    "context_sweep": ["model=tiny", "contexts=[256,1024]", "batch_size=2", "output_len=4"],
    "rate_sweep": ["model=tiny", "rates=[5,50]", "num_requests=8"],
    "kernel_ablation": ["contexts=[1000]", "decode_batches=[1,3]", "prefill_q_lens=[100]"],
    "gemm_case_study": ["sizes=[300]"],
    "interconnect_sweep": ["contexts=[512,2048]"],
    "cpu_attention": ["model=tiny", "points=[[3,100],[2,300]]", "warmup=0", "repeats=2"],
}
MEASURED_ON_CPU = {"cpu_attention"}  # the CPU is its device: its rows are measured here too


def _compose(overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=overrides)


def test_every_experiment_has_a_small_test():
    assert set(SMALL) == set(group_options("exp"))


@pytest.mark.parametrize("group", ["model", "hardware", "system", "workload"])
def test_every_config_composes(group):
    for option in group_options(group):
        for exp in group_options("exp"):
            cfg = _compose([f"+exp={exp}", f"{group}={option}", "run_id=t"])
            assert cfg.exp_name == exp and cfg[group] is not None


SAMPLES = REPO.parent / "shared" / "data"


@pytest.mark.parametrize("exp", sorted(SMALL))
def test_experiment_runs_on_cpu(exp, tmp_path):
    if exp == "rate_sweep" and not (SAMPLES / "sharegpt").is_dir():
        pytest.skip("ShareGPT/Alpaca samples (../shared/data) not beside this checkout")
    cfg = _compose([f"+exp={exp}", "run_id=t", "progress=false", "device=cpu", *SMALL[exp]])
    path = run_experiment(cfg, tmp_path)
    df = pd.read_parquet(path)
    assert len(df) > 0 and set(df["exp"]) == {exp}
    modes = {"measured"} if exp in MEASURED_ON_CPU else {"simulated", "projected"}
    assert set(df["mode"]) <= modes and set(df["status"]) <= {"ok", "oom"}
    ok = df[df["status"] == "ok"]
    assert (ok["time_ms"] > 0).all()
    assert (tmp_path / "manifest.json").exists()
    assert list((tmp_path / "figures").glob("*.png")), "figures rendered"
    if exp in ("context_sweep", "rate_sweep") and cfg.hardware.name == "h200-pcie5":  # the factors and host times used
        cost = json.loads((tmp_path / "manifest.json").read_text())["cost_model"]
        assert cost["calibrated"] and set(cost["host_time"]) >= {"hbm", "swap", "directkv-stream"}


def test_cpu_attention_measures_both_kernels_and_checks_them(tmp_path):
    cfg = _compose(["+exp=cpu_attention", "run_id=t", "progress=false", "render=false", "model=tiny",
                    "points=[[5,77]]", "threads=2", "warmup=0", "repeats=1"])
    df = pd.read_parquet(run_experiment(cfg, tmp_path))
    assert sorted(zip(df["page_order"], df["variant"], strict=True)) == [
        ("consecutive", "flash"), ("consecutive", "native"), ("shuffled", "flash"), ("shuffled", "native")]
    assert (df["rel_err"] < 1e-2).all() and (df["gbps"] > 0).all() and set(df["threads"]) == {2}
    assert (df.loc[df["variant"] == "native", "rel_err"] < 1e-4).all()  # fp32 throughout on exact bf16 inputs
    from directkv.kernels.cpu_decode_attention import kernel_item  # model=tiny's heads, as the rows ran them

    tiny = df.iloc[0]
    item = kernel_item(torch.bfloat16, int(tiny["num_heads"]), int(tiny["num_kv_heads"]), int(tiny["head_dim"]))
    assert (df.loc[df["variant"] == "native", "native_item"] == item).all()
    assert df["hardware"].str.startswith("cpu: ").all() and set(df["clock"]) == {"perf_counter"}


def test_cpu_attention_runs_flash_on_its_threads_and_restores_torchs(tmp_path, monkeypatch):
    """flash runs on torch's intra-op threads: the run sets them to `threads` and puts them back after."""
    import experiments.cpu_attention as cpu_attention

    seen, real = [], cpu_attention.kernel_fn
    monkeypatch.setattr(cpu_attention, "kernel_fn", lambda *a: seen.append(torch.get_num_threads()) or real(*a))
    before = torch.get_num_threads()
    cfg = _compose(["+exp=cpu_attention", "run_id=t", "progress=false", "render=false", "model=tiny",
                    "points=[[2,40]]", "page_orders=[consecutive]", "kernels=[flash]", f"threads={before + 1}",
                    "warmup=0", "repeats=1"])
    run_experiment(cfg, tmp_path)
    assert seen == [before + 1] and torch.get_num_threads() == before


def test_gemm_simulates_row_panels_beside_column_panels(tmp_path):
    cfg = _compose(["+exp=gemm_case_study", "run_id=t", "progress=false", "render=false", "device=cpu",
                    "sizes=[4096]", "variants=[stream,stream:k]"])
    df = pd.read_parquet(run_experiment(cfg, tmp_path)).set_index("variant")
    assert df.loc["stream", "panel_cols"] == 576 and df.loc["stream:k", "panel_rows"] == 576  # 8 panels each
    # the same bytes cross the link by the copy engine; row panels also read and write C once per panel
    assert df.loc["stream:k", "link_read_bytes"] == df.loc["stream", "link_read_bytes"] == 4096 * 4096 * 2
    assert df.loc["stream:k", "hbm_write_bytes"] > df.loc["stream", "hbm_write_bytes"]
    assert (df.loc[["stream", "stream:k"], "time_ms"] >= df.loc[["stream", "stream:k"], "floor_ms"]).all()


def test_gemm_simulates_the_kernels_schedules(tmp_path):
    # naive streams 64-row k tiles; tiled / pipelined keep 512-row chunks of B stationary, and the model (the reference
    # kernel's in-place schedule) makes one fp32 partial-C pass per chunk after the first: 4096 / 512 - 1 passes of
    # 4096^2 floats, written and read once each (the CUDA kernel's split reduction adds one more each way)
    cfg = _compose(["+exp=gemm_case_study", "run_id=t", "progress=false", "render=false", "device=cpu",
                    "sizes=[4096]", "variants=[naive,tiled,pipelined]"])
    df = pd.read_parquet(run_experiment(cfg, tmp_path)).set_index("variant")
    c16, partial = 4096 * 4096 * 2, 7 * 4096 * 4096 * 4
    assert df.loc["tiled", "hbm_write_bytes"] == df.loc["pipelined", "hbm_write_bytes"] == c16 + partial
    assert df.loc["naive", "hbm_write_bytes"] == c16 and df.loc["naive", "link_read_bytes"] == 32 * c16


def test_context_sweep_directkv_survives_where_hbm_runs_out(tmp_path):
    cfg = _compose(["+exp=context_sweep", "run_id=t", "progress=false", "device=cpu", "render=false",
                    "contexts=[16384,32768]", "system.names=[directkv,hbm]"])
    df = pd.read_parquet(run_experiment(cfg, tmp_path)).set_index(["system", "context_len"])
    assert df.loc[("hbm", 32768.0), "status"] == "oom" and "budget" in df.loc[("hbm", 32768.0), "error"]
    assert df.loc[("directkv", 32768.0), "status"] == "ok"
    assert df.loc[("directkv", 16384.0), "gpu_mem_gb"] < 0.55 * df.loc[("hbm", 16384.0), "gpu_mem_gb"]


def _cli(*args, cwd):
    # the repository first, then the caller's own path (the device machine puts hydra there, not in site-packages)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "experiments.run", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=300)


@pytest.mark.parametrize("args,needle", [
    (["+exp=nope"], "unknown exp 'nope'; valid: context_sweep"),
    (["+exp=context_sweep", "model=llama-8b"], "unknown model 'llama-8b'; valid:"),
    (["+exp=context_sweep", "system=vllm"], "unknown system 'vllm'; valid:"),
    (["+exp=context_sweep", "hardware=a100"], "unknown hardware 'a100'; valid:"),
    ([], "choose an experiment with +exp=NAME"),
    (["+exp=rate_sweep", "rates=[0]"], "rate must be > 0"),
    (["+exp=context_sweep", "contexts=[200000]"], "exceeds llama-3.1-8b's limit"),
    (["+exp=context_sweep", "model=opt-13b"], "context 32768 + output_len 128 = 32896 tokens exceeds opt-13b's "
                                              "limit of 32768; with output_len=128 contexts must be <= 32640"),
    (["+exp=context_sweep", "hardware.hbm_budget_gb=-1"], "hbm_budget_gb must be in"),
    (["+exp=context_sweep", "system.names=[pie]"], "unknown system 'pie'"),
    (["+exp=rate_sweep", "system.names=[swap,hbm,swap]"], "system.names lists swap more than once; each system runs once per point"),
    (["+exp=context_sweep", "contexts=[abc]"], "context length must be an integer, got 'abc'"),
    (["+exp=context_sweep", "model=tiny", "contexts=[256]", "batch_size=x"], "batch_size must be an integer"),
    (["+exp=context_sweep", "memory.page_size=3"], "page_size must be a power of two, got 3"),
    (["+exp=context_sweep", "foo=1"], "unknown config key 'foo'; keys: batch_size, contexts, counters, device"),
    (["+exp=context_sweep", "bach_size=4"], "unknown config key 'bach_size' (did you mean 'batch_size'?); keys:"),
    (["+exp=context_sweep", "executor.cuda_graph=false"],
     "unknown config key 'executor.cuda_graph' (did you mean 'executor.cuda_graphs'?); keys of executor:"),
    (["+exp=context_sweep", "+bach_size=4"], "+bach_size adds a key no experiment reads; set an existing key without"),
    (["+exp=context_sweep", "contexts=[]"], "give at least one context length; got an empty list"),
    (["+exp=interconnect_sweep", "ops=[]"], "interconnect_sweep has no points to run: a list override (contexts, "),
    (["+exp=context_sweep", "batch_size=true"], "batch_size must be an integer, got True"),
    (["+exp=context_sweep", "hardware.hbm_budget_gb=abc"], "hardware.hbm_budget_gb must be a number, got 'abc'"),
    (["+exp=context_sweep", "counters=ncu"], "counters=ncu profiles kernels and applies to kernel_ablation, "
                                             "gemm_case_study, not context_sweep"),
    (["+exp=rate_sweep", "counters=bogus"], "unknown counters 'bogus'; valid: none, ncu"),
    (["+exp=rate_sweep", "workload=alpaca", "datasets=[sharegpt]"], "datasets=['sharegpt'] does not include alpaca"),
    (["+exp=rate_sweep", "warmup_requests=-1"], "warmup_requests must be >= 0, got -1"),
    (["+exp=context_sweep", "executor.cuda_graphs=maybe"], "executor.cuda_graphs must be true or false; got 'maybe'"),
    (["+exp=context_sweep", "executor.cpu_attn_kernel=ispc"], "unknown executor.cpu_attn_kernel 'ispc'; valid: flash, native"),
    (["+exp=context_sweep", "executor.prefill_new_pass=sdpa"], "unknown executor.prefill_new_pass 'sdpa'; valid: flash, kernel"),
    (["+exp=context_sweep", "executor.directkv_pipelined=maybe"], "executor.directkv_pipelined must be true or false; got 'maybe'"),
    (["+exp=context_sweep", "executor.directkv_pipelined=true", "system.directkv_variant=stream"],
     "executor.directkv_pipelined runs directkv variants naive and tiled; got variant 'stream'"),
    (["+exp=context_sweep", "executor.directkv_side_ctas=0"],
     "executor.directkv_side_ctas must be an integer >= 1 or null (the kernel's own plan); got 0"),
    (["+exp=context_sweep", "executor.directkv_side_ctas=many"],
     "executor.directkv_side_ctas must be an integer >= 1 or null (the kernel's own plan); got 'many'"),
    (["+exp=context_sweep", "executor.directkv_pipeline_min_kv_mb=lots"],
     "executor.directkv_pipeline_min_kv_mb must be a number >= 0; got 'lots'"),
    (["+exp=kernel_ablation", "counters=bogus"], "unknown counters 'bogus'; valid: none, ncu"),  # simulated too
    (["+exp=interconnect_sweep", "progress=maybe"], "progress must be true or false; got 'maybe'"),
    (["+exp=gemm_case_study", "counters=ncux"], "unknown counters 'ncux'; valid: none, ncu"),
    (["+exp=cpu_attention", "kernels=[ispc]"], "unknown cpu_attention kernel 'ispc'; valid: flash, native"),
    (["+exp=cpu_attention", "points=[[0,100]]"], "decodes must be >= 1, got 0"),
    (["+exp=cpu_attention", "page_orders=[random]"], "unknown cpu_attention page order 'random'; valid: consecutive, shuffled"),
    (["+exp=rate_sweep", "workload=alpaca", "workload.path=/nope.json", "datasets=[alpaca]", "rates=[5]"],
     "Alpaca file not found: '/nope.json'"),
])
def test_bad_input_gets_one_line_and_exit_2(args, needle, tmp_path):
    p = _cli(*args, f"results_root={tmp_path}", cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], p.stderr
    assert "Traceback" not in p.stderr
    assert not [f for f in tmp_path.rglob("*") if f.is_file()]  # a refused run leaves no folder, manifest or log


def test_a_multirun_override_of_an_unknown_key_is_one_line_too(tmp_path):
    p = _cli("+exp=context_sweep", "bach_size=1,2", "contexts=[1024,2048],[4096]", f"results_root={tmp_path}", "-m",
             cwd=tmp_path)
    assert p.returncode == 2 and p.stderr.startswith("error: unknown config key 'bach_size' (did you mean "
                                                     "'batch_size'?)") and len(p.stderr.splitlines()) == 1, p.stderr


def test_a_results_root_under_a_file_is_refused_in_one_line(tmp_path):
    (tmp_path / "afile").write_text("")
    p = _cli("+exp=context_sweep", f"results_root={tmp_path / 'afile' / 'x'}", cwd=tmp_path)
    assert p.returncode == 2 and p.stderr.strip() == (f"error: results_root '{tmp_path / 'afile' / 'x'}' lies under "
                                                      f"'{tmp_path / 'afile'}', a file, not a folder"), p.stderr


def test_a_rerun_under_other_overrides_is_refused_and_a_single_context_is_a_list(tmp_path):
    tiny = ["+exp=context_sweep", "system=directkv", "model=tiny", "batch_size=2", "output_len=4", "render=false",
            "progress=false", "device=cpu", "run_id=r", f"results_root={tmp_path}"]
    assert _cli(*tiny, "contexts=256", cwd=tmp_path).returncode == 0  # one value, not a list: a list of one
    run = tmp_path / "context_sweep" / "r"
    before = {f.name: f.read_bytes() for f in run.iterdir()}
    p = _cli(*tiny, "contexts=[512]", cwd=tmp_path)
    assert p.returncode == 2 and p.stderr.startswith(f"error: {run} holds 1 row of another configuration "
                                                     "(contexts differ); resume it with the overrides and code"), p.stderr
    assert {f.name: f.read_bytes() for f in run.iterdir()} == before


def test_multirun_outputs_do_not_collide(tmp_path):
    p = _cli("-m", "+exp=context_sweep", "system=directkv,hbm", "model=tiny", "contexts=[256]", "batch_size=2",
             "output_len=4", "render=false", "progress=false", "device=cpu", f"results_root={tmp_path}", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    runs = sorted((tmp_path / "context_sweep").glob("*/results.parquet"))
    assert len(runs) == 2
    assert {pd.read_parquet(r)["system"].iloc[0] for r in runs} == {"directkv", "hbm"}


def test_a_multirun_resumed_in_another_order_finds_each_jobs_folder(tmp_path):
    """Hydra numbers a sweep's folders by position: resumed with its values reordered and one added, each job still
    finds the folder its config wrote (finished points skipped, rows untouched) and the new value a new folder."""
    base = ["-m", "+exp=context_sweep", "model=tiny", "contexts=[256]", "batch_size=2", "output_len=4", "render=false",
            "progress=false", "device=cpu", "run_id=s", f"results_root={tmp_path}"]
    assert _cli(*base, "system=directkv,hbm", cwd=tmp_path).returncode == 0
    sweep = tmp_path / "context_sweep"
    before = {p.name: (p / "results.parquet").read_bytes() for p in sweep.iterdir() if p.is_dir()}
    assert sorted(before) == ["s-0", "s-1"]
    p = _cli(*base, "system=hbm,swap,directkv", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert sorted(f.name for f in sweep.iterdir() if f.is_dir()) == ["s-0", "s-1", "s-2"]
    for name, rows in before.items():
        assert (sweep / name / "results.parquet").read_bytes() == rows
        assert "resumed_at" in json.loads((sweep / name / "manifest.json").read_text())
    systems = {name: pd.read_parquet(sweep / name / "results.parquet")["system"].unique().tolist()
               for name in ("s-0", "s-1", "s-2")}
    assert systems == {"s-0": ["directkv"], "s-1": ["hbm"], "s-2": ["swap"]}
    # each moved job's log followed it to its folder, and says why
    assert "multirun job s-0: resuming the rows its configuration wrote in" in (sweep / "s-1" / "run.log").read_text()
    assert f"multirun job s-1: a new folder {sweep / 's-2'}" in (sweep / "s-2" / "run.log").read_text()


def _sweep_job(run_id, **config):
    """A multirun job's config, as _sweep_job_dir reads it (the keys that matter to resume, and run_id)."""
    from omegaconf import OmegaConf

    return OmegaConf.create({"run_id": run_id, "system": "hbm", **config})


def _job_folder(path, *, manifest=None, rows=False, log=""):
    """A sweep folder as an earlier job left it: its manifest's config, its rows, its log."""
    path.mkdir(parents=True)
    if manifest is not None:
        (path / "manifest.json").write_text(json.dumps({"config": manifest}))
    if rows:
        pd.DataFrame({"system": [manifest.get("system") if manifest else "?"]}).to_parquet(path / "results.parquet")
    (path / "run.log").write_text(log)
    return path


@pytest.mark.parametrize("run_id", ["a/b", "[s]", "s*?"])
def test_a_multirun_whose_run_id_has_a_slash_or_glob_characters_finds_its_folder(tmp_path, run_id):
    from experiments.run import _sweep_job_dir

    cfg = _sweep_job(run_id)
    other = _job_folder(tmp_path / f"{run_id}-0", manifest={**cfg, "system": "swap"}, rows=True)
    mine = _job_folder(tmp_path / f"{run_id}-1", manifest=dict(cfg), rows=True)
    _job_folder(tmp_path / f"{run_id}-\u00b2")  # not a number, though str.isdigit says so
    assert _sweep_job_dir(other, cfg) == mine
    mine.rename(tmp_path / "elsewhere")
    assert _sweep_job_dir(other, cfg) == mine  # now the next free number, made afresh
    assert not list(mine.iterdir())


def test_a_multirun_job_moving_away_drops_only_hydras_empty_log_from_its_positional_folder(tmp_path):
    """An earlier attempt of another config that wrote no rows keeps its manifest and log; a folder Hydra just
    made (an empty run.log) goes."""
    from experiments.run import _sweep_job_dir

    cfg = _sweep_job("s")
    mine = _job_folder(tmp_path / "s-0", manifest=dict(cfg), rows=True)
    attempt = _job_folder(tmp_path / "s-1", manifest={**cfg, "system": "swap"})
    logged = _job_folder(tmp_path / "s-2", log="an earlier attempt's log\n")
    fresh = _job_folder(tmp_path / "s-3")
    for positional in (attempt, logged, fresh):
        assert _sweep_job_dir(positional, cfg) == mine
    assert json.loads((attempt / "manifest.json").read_text())["config"]["system"] == "swap"
    assert (logged / "run.log").read_text() == "an earlier attempt's log\n"
    assert not fresh.exists()


def test_a_multirun_job_takes_only_a_folder_whose_manifest_names_its_run_id_and_config(tmp_path):
    """A single run named `s-5` under the same config is not sweep s's; a rowless earlier attempt of the job's own
    config is taken before a new number, one of another config is not."""
    from experiments.run import _sweep_job_dir

    cfg = _sweep_job("s")
    _job_folder(tmp_path / "s-5", manifest={**cfg, "run_id": "s-5"}, rows=True)
    fresh = _job_folder(tmp_path / "s-0")
    assert _sweep_job_dir(fresh, cfg) == fresh
    taken = _job_folder(tmp_path / "s-1", manifest={**cfg, "system": "swap"}, rows=True)
    _job_folder(tmp_path / "s-2", manifest={**cfg, "system": "swap"})
    assert _sweep_job_dir(taken, cfg) == tmp_path / "s-6"  # not s-2 (another config's) nor s-5 (another run's)
    attempt = _job_folder(tmp_path / "s-3", manifest=dict(cfg))
    assert _sweep_job_dir(taken, cfg) == attempt


def test_rate_sweep_hands_the_workload_group_to_its_dataset():
    from experiments.rate_sweep import dataset_options

    cfg = _compose(["+exp=rate_sweep", "workload=sharegpt", "workload.path=/data/sg.json", "workload.max_prompt=512"])
    assert dataset_options(cfg, "sharegpt", 7) == {"num_requests": 7, "seed": 0, "path": "/data/sg.json",
                                                   "min_prompt": 4, "max_prompt": 512, "max_total": 2048}
    assert dataset_options(cfg, "alpaca", 7) == {"num_requests": 7, "seed": 0}  # another dataset's defaults


def test_rate_sweep_leaves_warm_up_requests_out_of_the_metrics(tmp_path):
    if not (SAMPLES / "alpaca").is_dir():
        pytest.skip("Alpaca sample (../shared/data) not beside this checkout")
    cfg = _compose(["+exp=rate_sweep", "run_id=t", "progress=false", "device=cpu", "render=false", "model=tiny",
                    "datasets=[alpaca]", "rates=[5]", "num_requests=6", "warmup_requests=3", "system.names=[hbm]"])
    df = pd.read_parquet(run_experiment(cfg, tmp_path))
    assert (df["num_requests"] == 6).all() and (df["warmup_requests"] == 3).all() and (df["completed"] == 6).all()


def test_pipelined_directkv_is_simulated_pipelined_and_says_so(tmp_path):
    """executor.directkv_pipelined: the simulated directkv rows run Pipelining's cuts too and carry the same
    columns as measured ones, so plots.compare pairs them; other systems' rows do not."""
    cfg = _compose(["+exp=context_sweep", "run_id=t", "progress=false", "render=false", "device=cpu",
                    "contexts=[16384]", "batch_size=4", "output_len=4", "system.names=[directkv,hbm]",
                    "executor.directkv_pipelined=true"])
    df = pd.read_parquet(run_experiment(cfg, tmp_path)).set_index("system")
    assert bool(df.loc["directkv", "directkv_pipelined"]) and bool(df.loc["directkv", "directkv_pipeline_mixed"])
    assert pd.isna(df.loc["hbm", "directkv_pipelined"])
    one = _compose(["+exp=context_sweep", "run_id=u", "progress=false", "render=false", "device=cpu",
                    "contexts=[16384]", "batch_size=4", "output_len=4", "system.names=[directkv]"])
    base = pd.read_parquet(run_experiment(one, tmp_path / "one")).set_index("system")
    assert "directkv_pipelined" not in base.columns
    assert df.loc["directkv", "tpot_ms"] != base.loc["directkv", "tpot_ms"]  # its mixed steps were cut


def test_a_figure_that_fails_keeps_the_results_and_says_how_to_render_them(tmp_path, monkeypatch, caplog):
    import plots.render

    def broken(run_dir):
        raise ValueError("no palette")

    monkeypatch.setattr(plots.render, "render_run", broken)
    cfg = _compose(["+exp=gemm_case_study", "run_id=t", "progress=false", "device=cpu", "sizes=[4096]",
                    "variants=[stream]"])
    with caplog.at_level("ERROR"):
        path = run_experiment(cfg, tmp_path)
    assert len(pd.read_parquet(path)) > 0 and (tmp_path / "manifest.json").exists()
    assert f"figures not rendered (ValueError: no palette); the results are in {path}: python -m plots.render" \
        in caplog.text
