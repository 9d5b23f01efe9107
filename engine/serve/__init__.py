"""`velox serve`: a local OpenAI-compatible server on mlx-lm's own server, holding Velox's compressed caches.

`server.VeloxServer` runs it; `provider` makes mlx-lm's model provider and prompt cache hold Velox caches
(and says which part of mlx-lm's server cannot); `handler` puts the safety checks in front of mlx-lm's
request handler; `example` is the client snippet shown by `--help` and the app. Only `example` is free
of MLX (the others import mlx-lm: call `engine.runtime.prepare_runtime()` first), so nothing is imported
here.
"""
