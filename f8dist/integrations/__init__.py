"""Integrations of f8dist with training frameworks.

Each lives in its own module and imports its framework only when imported itself, so
``import f8dist`` never needs one:

* ``f8dist.integrations.torchtitan``: a torchtitan model converter (``pip install -e
  ".[torchtitan]"``; ``docs/torchtitan.md``).
"""
