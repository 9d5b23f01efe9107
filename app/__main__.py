"""`python -m app [--model MODEL]`: start the Velox desktop app on the embedded default model (or MODEL)."""

from __future__ import annotations

import argparse
import sys

from app.main import run_app


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m app", description="The Velox desktop app.")
    parser.add_argument("--model", "-m", default=None,
                        help="model folder, 'org/name' in the Hugging Face cache, or 'default'")
    args = parser.parse_args()
    return run_app(model=args.model)


if __name__ == "__main__":
    sys.exit(main())
