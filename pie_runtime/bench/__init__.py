"""Benchmark helpers for `pie bench decode`: the result schema and table (``report``), peak-RSS reading
(``rss``), the engine side (``pie_runs``), the transformers worker (``hf_worker``), and llama.cpp's on-demand
install (``llama_cpp_env``) and worker (``llama_worker``, a standalone script run by that install's Python)."""
