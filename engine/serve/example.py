"""How to point the `openai` Python client at a Velox server (shown by `velox serve --help` and the app).
Imports nothing heavy: the CLI builds its help before the MLX runtime is set up."""

from __future__ import annotations

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
DEFAULT_PREFILL_STEP = 2048  # prompt tokens per model call (mlx-lm's default; see BENCHMARKS.md's prefill step)


def base_url(host: str = DEFAULT_HOST, port: int = DEFAULT_PORT) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/v1"


def client_example(url: str = base_url(), api_key: str | None = None) -> str:
    """A short Python program that asks the server one question with the `openai` package."""
    key = f'"{api_key}"' if api_key else '"not-needed"'
    note = "" if api_key else "# api_key: any text, or the --api-key the server was started with\n"
    return (
        "from openai import OpenAI\n\n"
        f"{note}"
        f'client = OpenAI(base_url="{url}", api_key={key})\n'
        "reply = client.chat.completions.create(\n"
        '    model="default",\n'
        '    messages=[{"role": "user", "content": "What is the capital of France?"}],\n'
        ")\n"
        "print(reply.choices[0].message.content)\n"
    )
