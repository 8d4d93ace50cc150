"""``python -m service.demo [--root DIR]``: build the demo assets and print their paths."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from rayeval.service.demo import default_demo_root, ensure_demo_assets


def main(argv: list[str] | None = None) -> None:
    """Build (if needed) the tiny demo model and task YAMLs, then print both paths."""
    parser = argparse.ArgumentParser(
        prog="python -m service.demo",
        description="Build the bundled tiny demo model and lm-eval demo tasks.",
    )
    parser.add_argument(
        "--root",
        type=Path,
        default=None,
        help=f"cache directory (default: $RAYEVAL_DEMO_DIR or {default_demo_root()})",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    assets = ensure_demo_assets(args.root)
    print(f"model_dir: {assets.model_dir}")
    print(f"tasks_dir: {assets.tasks_dir}")
    print(f"code_tasks_dir: {assets.code_tasks_dir}")


if __name__ == "__main__":
    main()
