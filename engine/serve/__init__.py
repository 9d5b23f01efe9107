"""`velox serve`: a local OpenAI-compatible server on mlx-lm's own server, holding Velox's compressed caches.

`server.VeloxServer` runs it; `provider` makes mlx-lm's model provider and prompt cache hold Velox caches
(and says which part of mlx-lm's server cannot); `handler` puts the safety checks in front of mlx-lm's
request handler. Importing this package imports MLX: call `engine.runtime.prepare_runtime()` first.
"""

from engine.serve.server import ServeError, ServeOptions, VeloxServer, is_loopback

__all__ = ["ServeError", "ServeOptions", "VeloxServer", "is_loopback"]
