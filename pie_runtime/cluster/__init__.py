"""Scaling out past one engine (docs/architecture.md, "Beyond one engine").

The router policy (``router``, ``prefix_tree``, ``rendezvous``) is pure Python and imports neither Ray nor
torch. The Ray control plane (``ray_actors``, ``backend``) is imported only by ``pie serve --engines N``; Ray is
the optional extra ``pie-runtime[ray]``.
"""
