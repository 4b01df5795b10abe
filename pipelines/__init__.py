"""Ray jobs of kvrank, one module per job, each runnable with ``python -m pipelines.<job>``.

This package and ``services`` are the only places that import Ray; the math is in ``models``.
"""
