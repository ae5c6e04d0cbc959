"""Third-party names without a public home, one module per library: the bottom layer.

Each module names the private (or experimental) names of one library that the rest of the package
uses, says what runs without each, and is the only place that touches them: ``otel_sdk.py`` (the
OpenTelemetry SDK's logs signal, gauge class, retry loop and reader hook), ``otlp_failures.py`` (why
an OTLP export failed, from the exporters' own log lines), ``ray_internals.py`` (Ray's driver
mode, actor ids and method signatures), ``wandb_internals.py`` (steps handed to wandb's service
as ``run.log`` would), ``swanlab_internals.py`` and ``trackio_internals.py`` (a step's event or
row, as ``run.log`` would make it), ``tensorboard_internals.py`` (its record writer's checksum),
``verl_internals.py`` (the two verl functions the verl switch replaces, a worker's rank in its group).
Tests against the release each is pinned to fail when a name moves (``tests/test_ray_internals.py``,
``tests/test_wandb_fast_steps.py``, ``tests/test_swanlab_steps.py``, ``tests/test_backend_trackio.py``,
``tests/test_tensorboard_internals.py``, ``tests/verl/test_verl_internals.py``; the OpenTelemetry
names: the core tests on the oldest and the newest SDK allowed, ``scripts/test``).
Imports nothing from otel_tracking; no library is imported before it is used.
"""
