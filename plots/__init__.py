"""Paper figures rebuilt from a results directory alone: `python -m plots.render RESULTS_DIR`.

`plots.render.render_run(run_dir)` reads `results.parquet` + `manifest.json` and writes one PNG per
paper figure into `run_dir/figures/`. Figure functions live in `plots/figures/`, one file per experiment.
"""
