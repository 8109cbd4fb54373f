"""Held-out accuracy of the embedded default model on synthetic images, through deltaserve's own engine.

Each held-out example (`make_vision_data.py`, held-out split: pictures never seen in training) is rendered by the
chat format the server uses, sent with its image to `LLM.generate` (greedy), and scored two ways: `exact` (the
answer is the expected sentence) and `label` (the answer states the right fact: the colour, shape, count or word;
for a description both colour and shape, and for several shapes the count as well). `--heldout-phrasing` asks
with question phrasings the training never used.

    python scripts/eval_vision.py --n 400
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_vision_data import NUMBER_WORDS, VisionExample, make_example, split_rng  # noqa: E402

from deltaserve import LLM, SamplingParams  # noqa: E402
from deltaserve.chat import ChatMessage, get_chat_format  # noqa: E402
from deltaserve.chat.media import ImageSlot  # noqa: E402
from deltaserve.multimodal import ImageProcessingConfig, preprocess_image  # noqa: E402
from deltaserve.multimodal.image_loader import load_pil_image  # noqa: E402


def states_label(example: VisionExample, answer: str) -> bool:
    """Whether `answer` states the example's fact (and no other value of the same kind where that is checkable)."""
    words = set(re.findall(r"[a-z0-9]+", answer.lower()))
    if example.kind == "describe" and " " in example.label:
        colour, shape = example.label.split(" ")
        count_ok = True
        if example.answer.split(" ")[0].lower() in NUMBER_WORDS:
            count_ok = example.answer.split(" ")[0].lower() in words
            shape += "s"
        return colour in words and shape in words and count_ok
    return example.label.lower() in words


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a checkpoint directory (default: the embedded model)")
    parser.add_argument("--n", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--heldout-phrasing", action="store_true")
    parser.add_argument("--json", type=Path, default=None, help="write the scores here")
    parser.add_argument("--show", default=None, help="print answers to this kind of question (default: any kind)")
    args = parser.parse_args()
    llm = LLM(model=args.model) if args.model else LLM()
    model_dir = llm.engine.config.model
    vision = llm.engine.model_config.vision
    if vision is None:
        raise SystemExit(f"{model_dir} has no vision tower")
    fmt = get_chat_format(model_dir, llm.tokenizer)
    processing = ImageProcessingConfig.for_vision(vision)
    rng = split_rng("heldout", args.seed)
    examples = [make_example(rng, heldout_phrasing=args.heldout_phrasing) for _ in range(args.n)]
    prompts = []
    for ex in examples:
        tokens = preprocess_image(load_pil_image(ex.image), processing).num_tokens
        slot = ImageSlot(position=0, num_tokens=tokens)
        ids = fmt.render([ChatMessage(role="user", content=ex.question, images=(slot,))], thinking=False)
        prompts.append({"prompt_token_ids": ids, "multi_modal_data": {"image": ex.image}})
    started = time.time()
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24))
    scores: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for ex, out in zip(examples, outputs, strict=True):
        text = out.outputs[0].text.strip()
        for key in (ex.kind, "all"):
            scores[key][0] += text == ex.answer
            scores[key][1] += states_label(ex, text)
            scores[key][2] += 1
    print(f"{args.n} held-out examples in {time.time() - started:.1f} s"
          f"{' (held-out phrasings)' if args.heldout_phrasing else ''}")
    print(f"{'kind':10} {'n':>4} {'exact':>7} {'label':>7}")
    table = {}
    for kind in sorted(scores, key=lambda k: (k == "all", k)):
        exact, label, n = scores[kind]
        table[kind] = {"n": n, "exact": exact / n, "label": label / n}
        print(f"{kind:10} {n:4d} {exact / n:7.1%} {label / n:7.1%}")
    shown = [(ex, out) for ex, out in zip(examples, outputs, strict=True) if args.show in (None, ex.kind)]
    for ex, out in shown[:8]:
        print(f"  Q {ex.question!r} -> {out.outputs[0].text.strip()!r} (expected {ex.answer!r})")
    if args.json:
        args.json.write_text(json.dumps(table, indent=2) + "\n")


if __name__ == "__main__":
    main()
