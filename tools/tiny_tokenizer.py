"""Write a small CLIP BPE tokenizer in the on-disk layout of SD 1.5's ``tokenizer/`` folder.

The vocabulary is built the way CLIP's is: the 256 byte-level characters, the same 256 with the
end-of-word marker ``</w>``, one token per learned merge, then ``<|startoftext|>`` and
``<|endoftext|>``. The merges are a real BPE table learned greedily from a small built-in English
corpus, so common words become single tokens and rare ones split into pieces, just as with the
real 49408-token vocabulary. ``transformers.CLIPTokenizer.from_pretrained(out_dir)`` loads it.
Standard library only (the test-model generator imports it before torch).

    python tools/tiny_tokenizer.py OUT_DIR [--seed 0] [--num-merges 300]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
from collections import Counter
from pathlib import Path

BOS = "<|startoftext|>"
EOS = "<|endoftext|>"
EOW = "</w>"

# Prompt-flavoured English; the BPE table is learned from its word counts.
CORPUS = """
a photo of a cat sitting on a wooden table next to a window in the morning light.
a painting of a mountain landscape with a lake and a forest at sunset, highly detailed.
portrait of a young woman with long red hair, oil painting, trending on artstation.
an astronaut riding a horse on the moon, digital art, cinematic lighting, sharp focus.
a cute dog playing in the snow, professional photography, shallow depth of field.
a futuristic city at night with neon lights and flying cars, concept art, 4k, 8k.
a bowl of fresh fruit on the kitchen counter, still life, soft shadows, warm colors.
the old castle stands on the hill above the village, and the river runs under the bridge.
a beautiful garden full of flowers and butterflies in the spring, watercolor illustration.
an ancient temple in the jungle covered with moss and vines, matte painting, epic scale.
a small boat on the ocean during a storm with huge waves and dark clouds, dramatic sky.
a close up of a green leaf with water drops, macro photography, high resolution.
a man in a black suit walking down a rainy street in the city, film noir style.
a red sports car parked in front of a modern house, studio lighting, product photo.
the children are reading books in the library while the teacher is writing on the board.
a cozy cabin in the woods with smoke rising from the chimney, winter evening, snow.
a dragon flying over the mountains breathing fire, fantasy art, very detailed scales.
a plate of pasta with tomato sauce and basil, food photography, top view.
an owl sitting on a branch in the forest at night under the full moon, realistic.
a robot playing the piano in a concert hall, surreal, pastel colors, highly detailed.
the quick brown fox jumps over the lazy dog, and the cat watches from the garden wall.
a lighthouse on a rocky coast at dawn, long exposure, calm sea, golden hour.
a bustling market street with people, colorful fabrics and spices, travel photography.
a medieval knight in shining armor holding a sword, character design, full body.
a glass of water on a wooden table, simple, minimalist, white background.
a field of sunflowers under a blue sky with white clouds, bright summer day.
a portrait of an old man with a white beard and a hat, black and white photo.
a snowy mountain peak above the clouds, aerial view, crisp and clear, ultra wide.
a cup of coffee and a book on a table near the window, rainy day, soft light.
an underwater scene with coral reef and tropical fish, vibrant colors, sun rays.
the little girl is painting a picture of her house, her family and her small dog.
a tiger walking through the tall grass, wildlife photography, national geographic.
a steampunk airship flying over a victorian city, intricate details, brass and copper.
a bridge over a river in autumn with red and yellow trees, reflections in the water.
a bedroom with a large bed, white sheets and plants, interior design, natural light.
a horse running on the beach at sunset, motion blur, warm tones, beautiful photo.
a wizard casting a spell in a dark cave, glowing magic, fantasy illustration.
a train crossing a stone bridge in the mountains, green valley, summer landscape.
the best picture of the year shows a bird, a tree, a house and a person in the rain.
"""

_WORD_RE = re.compile(r"[a-z]+|[0-9]|[^\sa-z0-9]+")


def bytes_to_unicode() -> dict[int, str]:
    """CLIP/GPT-2's reversible map from bytes to printable unicode characters."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def _tie_break(seed: int, pair: tuple[str, str]) -> bytes:
    # A stable (not per-process randomised) order among equally frequent pairs.
    return hashlib.sha256(f"{seed}\0{pair[0]}\0{pair[1]}".encode()).digest()


def learn_merges(text: str, num_merges: int, seed: int = 0) -> list[tuple[str, str]]:
    """Greedy BPE on the words of text: repeatedly merge the most frequent adjacent pair."""
    byte_chars = bytes_to_unicode()
    words: Counter[tuple[str, ...]] = Counter()
    for word in _WORD_RE.findall(text.lower()):
        symbols = [byte_chars[b] for b in word.encode("utf-8")]
        symbols[-1] += EOW
        words[tuple(symbols)] += 1

    known = set(byte_chars.values()) | {c + EOW for c in byte_chars.values()}
    merges: list[tuple[str, str]] = []
    while len(merges) < num_merges:
        pairs: Counter[tuple[str, str]] = Counter()
        for symbols, count in words.items():
            for pair in zip(symbols, symbols[1:], strict=False):
                pairs[pair] += count
        # A merge must create a new token, so every merge adds exactly one vocabulary entry.
        candidates = [p for p in pairs if p[0] + p[1] not in known]
        if not candidates:
            break
        top = max(pairs[p] for p in candidates)
        best = min((p for p in candidates if pairs[p] == top), key=lambda p: _tie_break(seed, p))
        merged = best[0] + best[1]
        merges.append(best)
        known.add(merged)
        new_words: Counter[tuple[str, ...]] = Counter()
        for symbols, count in words.items():
            out: list[str] = []
            i = 0
            while i < len(symbols):
                if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                    out.append(merged)
                    i += 2
                else:
                    out.append(symbols[i])
                    i += 1
            new_words[tuple(out)] += count
        words = new_words
    return merges


def _added_token(content: str) -> dict:
    return {
        "__type": "AddedToken",
        "content": content,
        "lstrip": False,
        "normalized": True,
        "rstrip": False,
        "single_word": False,
    }


def write_tiny_clip_tokenizer(
    out_dir: Path,
    seed: int = 0,
    num_merges: int = 300,
    model_max_length: int = 77,
    pad_token: str = "<|endoftext|>",
) -> None:
    """Write vocab.json, merges.txt, special_tokens_map.json and tokenizer_config.json.

    Deterministic given the arguments. The seed orders equally frequent merge candidates, so
    different seeds give different (equally valid) tables. ``vocab_size`` is
    512 + merges + 2, where merges is num_merges unless the corpus runs out of pairs first.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    merges = learn_merges(CORPUS, num_merges, seed=seed)

    base = list(bytes_to_unicode().values())
    tokens = base + [c + EOW for c in base] + [a + b for a, b in merges] + [BOS, EOS]
    vocab = {token: i for i, token in enumerate(tokens)}
    if pad_token not in vocab:
        raise ValueError(f"pad_token {pad_token!r} is not in the vocabulary")

    (out_dir / "vocab.json").write_text(
        json.dumps(vocab, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    (out_dir / "merges.txt").write_text(
        "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8"
    )
    special = {
        "bos_token": {k: v for k, v in _added_token(BOS).items() if k != "__type"},
        "eos_token": {k: v for k, v in _added_token(EOS).items() if k != "__type"},
        "pad_token": pad_token,
        "unk_token": {k: v for k, v in _added_token(EOS).items() if k != "__type"},
    }
    (out_dir / "special_tokens_map.json").write_text(
        json.dumps(special, indent=2) + "\n", encoding="utf-8"
    )
    config = {
        "add_prefix_space": False,
        "bos_token": _added_token(BOS),
        "do_lower_case": True,
        "eos_token": _added_token(EOS),
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": pad_token,
        "special_tokens_map_file": "./special_tokens_map.json",
        "tokenizer_class": "CLIPTokenizer",
        "unk_token": _added_token(EOS),
    }
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2) + "\n", encoding="utf-8"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-merges", type=int, default=300)
    parser.add_argument("--model-max-length", type=int, default=77)
    parser.add_argument("--pad-token", default=EOS)
    args = parser.parse_args(argv)
    write_tiny_clip_tokenizer(
        args.out_dir,
        seed=args.seed,
        num_merges=args.num_merges,
        model_max_length=args.model_max_length,
        pad_token=args.pad_token,
    )
    print(f"wrote tiny CLIP tokenizer to {args.out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
