"""pie_runtime: a programmable LLM serving runtime (engine, models, protocol, CLI)."""
