"""The engine inside the real clients, through each framework's own extension points (optional extras).

``muser_ti.integrations.transformers``: ``register()`` (``attn_implementation="muser_ti"``) and ``MuserCache``,
a transformers ``Cache`` backed by the engine's planes.  ``muser_ti.integrations.mlx_lm``: ``make_cache(model)``
for mlx-lm's generate.  Each imports its framework; nothing here imports either.
"""
