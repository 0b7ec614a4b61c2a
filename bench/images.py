"""Time to first token with one image (encoder + prefill) and tokens/s after it, text-only beside it, on a vision
profile: the same question with and without an image, alternated round by round in one run (a load change hits
both alike), median of the rounds. The image rows: "cold" encodes the image (a new image each round), "cached"
sends the same image again (the encoder-output cache, serve.image_cache). Greedy, plain steps (speculate off).

    PYTHONPATH=$PWD .venv/bin/python bench/images.py [--config C] [--engine-dir DIR] [--rounds 7] [--new 32]

Without --config it runs the tiny random-weight vision model of test/tiny_vlm.py (made in a temporary folder:
transformers, no download), fp32, one slot.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "test"))

from spec_edge import artifacts  # noqa: E402
from spec_edge.config import Config, load  # noqa: E402
from spec_edge.runtime.requests import GenerateRequest, ImageInput  # noqa: E402
from spec_edge.runtime.scheduler import run_one  # noqa: E402


def image(seed: int) -> ImageInput:
    import numpy as np

    pixels = np.random.default_rng(seed).integers(0, 256, (480, 640, 3), dtype=np.uint8)  # a VGA camera frame
    return ImageInput(data=pixels.tobytes(), encoding="rgb8", width=640, height=480)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="a vision profile YAML (default: the tiny test model)")
    parser.add_argument("--engine-dir", help="runtime.engine_dir holding the graphs")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--new", type=int, default=32, help="new tokens per request")
    parser.add_argument("--work", help="the tiny model's folder and graphs go here (kept: a rerun exports nothing)")
    args = parser.parse_args()
    tmp = tempfile.TemporaryDirectory()
    work = Path(args.work or tmp.name)
    if args.config:
        cfg = load(args.config)
    else:
        from tiny_vlm import make_vlm

        folder = work / "vlm"
        cfg = Config().replace(**{
            "model.target": str(folder if (folder / "config.json").is_file() else make_vlm(folder)), "graphs.weights": "fp32", "graphs.batch_slots": 1,
            "graphs.max_context": 128, "graphs.prefill_chunk": 16, "graphs.k_values": [3],
            "graphs.layer_skip_layers": 2, "runtime.engine_dir": str(work / "engines"),
            "runtime.profile": "tiny-vlm"})
    if args.engine_dir:
        cfg = cfg.replace(**{"runtime.engine_dir": args.engine_dir})
    cfg = cfg.replace(**{"serve.reuse_prefix": False})  # every request prefills its whole prompt
    engine = artifacts.engine(cfg, progress=lambda message: print(message, file=sys.stderr))
    question = "Describe what the robot sees."
    kinds = {"text": lambda r: (), "image cold": lambda r: (image(1000 + r),), "image cached": lambda r: (image(0),)}
    run_one(engine, GenerateRequest(prompt=question, images=(image(0),), max_new_tokens=4, speculate=False))  # warm
    seen: dict[str, list] = {kind: [] for kind in kinds}
    for r in range(args.rounds):
        for kind, images in kinds.items():
            first: list[float] = []
            started = time.perf_counter()  # TTFT: from the request (its image decoded, encoded) to its first text
            result = run_one(engine, GenerateRequest(prompt=question, images=images(r), max_new_tokens=args.new,
                                                     speculate=False),
                             on_text=lambda delta, n: first.append(time.perf_counter()) if not first else None)
            seen[kind].append((first[0] - started, result.stats.tokens_per_s, result.prompt_tokens))
    print(f"{'request':<14}{'prompt tok':>11}{'TTFT ms':>10}{'x text':>8}{'tok/s after':>13}")
    text_ttft = statistics.median(t for t, _, _ in seen["text"])
    for kind, rows in seen.items():
        ttft, rate = statistics.median(t for t, _, _ in rows), statistics.median(s for _, s, _ in rows)
        print(f"{kind:<14}{rows[0][2]:>11}{ttft * 1e3:>10.1f}{ttft / text_ttft:>8.2f}{rate:>13.1f}")
    print(f"image encoder: {engine.info()['image_encoder']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
