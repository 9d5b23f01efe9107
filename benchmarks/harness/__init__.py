"""`velox bench`: the evaluation harness behind every figure Velox quotes (quality, memory, speed).

    velox bench quality|memory|speed|peers|gpu|report|all [--quick] [--out DIR]

Modules: `specs` (which caches are compared, as short strings), `quality` (teacher-forced perplexity and
KL through the compressed cache, needle in a haystack, greedy agreement), `memory` (bytes actually held),
`speed` (decode/prefill timings, each config in its own subprocess), `peers` (the `veloxquant-mlx` package
run in its own venv under the user cache dir), `gpu` (synthetic Llama-8B-shaped attention on a CUDA GPU),
`levels` (the rule behind the app's compression levels), `report/` (BENCHMARKS.md, README's block and the
figures: data, formatting, Jinja templates, matplotlib), `cli` (the command line). Every run writes JSON under the output folder;
the report is generated only from those files. Nothing here imports Qt.
"""
