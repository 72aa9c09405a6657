"""``dllm serve``: an OpenAI-compatible server over dllm's samplers (``pip install -e ".[serve]"``).

- ``dllm.serve.engine``: lanes (one ``dllm.generate`` per choice) whose model calls one thread batches;
- ``dllm.serve.requests``: request bodies -> validated jobs (400 naming the field, 404 for a model not served);
- ``dllm.serve.choice``: one choice's decoding and the text that is final (streams, stop strings);
- ``dllm.serve.app``: the FastAPI routes; ``dllm.serve.metrics``: Prometheus; ``dllm.serve.cli``: the command;
- ``dllm.serve.replicas``: ``--replicas N``, the app in N replicas behind Ray Serve (``pip install -e ".[replicas]"``).
"""
