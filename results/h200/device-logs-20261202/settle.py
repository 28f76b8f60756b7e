# Device-only probe (not part of the package): run experiments.run with a pause of SETTLE_S seconds after the
# process's first setup (weights, pinned arena, graph capture), before its first warm-up and measured requests.
# Tells a transient after setup (the pause removes the first system's slow start) from cold code paths (it does not).
import os
import sys
import time

from directkv.model.runner import ModelRunner

_orig = ModelRunner.enable_graphs
_done = []


def enable_graphs(self, *a, **k):
    r = _orig(self, *a, **k)
    if not _done:
        _done.append(1)
        t = float(os.environ.get("SETTLE_S", "20"))
        print(f"settle: sleeping {t} s after the first setup", flush=True)
        time.sleep(t)
    return r


ModelRunner.enable_graphs = enable_graphs
from experiments.run import main  # noqa: E402

sys.argv = ["experiments.run", *sys.argv[1:]]
main()
