"""pie_runtime: a programmable LLM serving runtime (engine, models, protocol, CLI)."""

import os

# OpenMP threads that spin while waiting collapse when another process shares the cores (an inferlet, a
# second engine, a benchmark's reference): a decode step measured 640 ms spinning against 137 ms passive on
# a loaded 2-core machine. It takes effect only if torch is not loaded yet; an explicit setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
