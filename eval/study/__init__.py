"""The speed study and the measuring tools (installed as ``dllm.eval.study``), apart from task evaluation.

``bench`` (``dllm bench``: samplers side by side, timed in one run; ``bench_report``, ``bench_cache``), the cost
model at a target's shape (``cost_model``, ``head_cost``), memory (``planner``: ``dllm plan``; ``real_shape``:
``dllm study real-shape``; ``load_memory``), trajectories (``trace``: ``dllm generate --trace``) and the plumbing
depth of ``generate`` (``call_depth``).
"""
