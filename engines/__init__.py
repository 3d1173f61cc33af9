"""Speech engines behind one small streaming interface (see `engines.base`).

The gateway imports only `engines.base` and `engines.registry`; each backend module is imported
lazily by the registry so a CPU-only machine never imports GPU code it cannot use.
"""
