"""Write a Stable Diffusion 1.5-architecture pipeline with random weights at the real sizes: the
command `make_random_sd.py --family sd15` under its earlier name (see that file).

    python tools/make_sd15_random.py OUT_DIR [--seed 0] [--dtype fp32|fp16]

`pad_vocabulary` is no longer used to write the model (its tokenizer is CLIP's real BPE now); it
stays while tests/compile/test_bench.py imports it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import make_random_sd  # noqa: E402
from tiny_tokenizer import BOS, EOS  # noqa: E402

CLIP_VOCAB_SIZE = 49408


def pad_vocabulary(tok_dir: Path, size: int = CLIP_VOCAB_SIZE) -> None:
    """Grow vocab.json to `size` ids with unreachable fillers; BOS and EOS take the last two."""
    path = tok_dir / "vocab.json"
    vocab = json.loads(path.read_text(encoding="utf-8"))
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if t not in (BOS, EOS)]
    if len(tokens) + 2 > size:
        raise ValueError(f"the tokenizer already has {len(tokens) + 2} tokens (> {size})")
    tokens += [f"<|filler_{i}|>" for i in range(size - 2 - len(tokens))]
    tokens += [BOS, EOS]
    padded = {t: i for i, t in enumerate(tokens)}
    path.write_text(
        json.dumps(padded, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8"
    )


def make_sd15_random(out_dir: Path, seed: int = 0) -> Path:
    """Write the full-size random SD 1.5 pipeline (fp32) to out_dir; returns out_dir."""
    return make_random_sd.make_random_sd(out_dir, family="sd15", seed=seed)


def main(argv: list[str] | None = None) -> int:
    return make_random_sd.main(argv, family="sd15")


if __name__ == "__main__":
    raise SystemExit(main())
