"""Runs verl's test scripts of its fused kernel unmodified against ``lmhead_torch`` (origin,
commit and licence: tests/upstream/README.md): they are scripts, not pytest tests, so
``test_run_verl.py`` runs them in subprocesses with ``shim/`` first on ``PYTHONPATH`` (its
``verl`` package makes verl's kernel ``lmhead_torch``'s drop-in and holds verl's own reference
functions, copied verbatim). They need CUDA: marked ``gpu`` and skipped without a GPU the library
supports."""

collect_ignore = ["test_linear_cross_entropy.py", "test_special_linear_cross_entropy_tp.py", "shim"]
