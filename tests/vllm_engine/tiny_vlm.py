"""A tiny, randomly initialised Qwen2-VL-style model, built locally (no model hub).

``make_model(out_dir)`` writes everything vLLM loads for ``--model out_dir``: ``config.json`` and
safetensors weights (transformers' ``Qwen2VLForConditionalGeneration`` with a 1-layer vision tower
and a 1-layer text model), a byte-level BPE tokenizer built with the ``tokenizers`` library that
knows Qwen2-VL's special tokens (``<|vision_start|>``, ``<|image_pad|>``, ...), and the processor
files. Weights come from a fixed seed, so every build is bit-identical.

Sizes: an image of ``side × side`` pixels (``side`` a multiple of 28) becomes
``(side / 28)²`` image tokens, each a row of ``hidden`` values (the text model's width): 224 px →
64 rows. ``vision_scale`` multiplies the vision tower's width and depth to make the encoder costly
(benchmarks); tests keep it at 1.

Run as a script to build one: ``python tiny_vlm.py OUT_DIR [--hidden N]``.
"""

from __future__ import annotations

import argparse
import json
import os

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
PATCH, MERGE = 14, 2
#: Chat messages -> the :func:`prompt` format (an image item becomes the vision placeholder).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
FACTOR = PATCH * MERGE  # pixels per image token side


def prompt(text: str = "Describe the image.") -> str:
    """A one-image prompt: the processor expands ``<|image_pad|>`` to the image's tokens."""
    return f"<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{text}<|im_end|>\n" \
           "<|im_start|>assistant\n"


def image_tokens(side: int) -> int:
    return (side // FACTOR) ** 2


def _tokenizer(out_dir: str) -> dict[str, int]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.processors import ByteLevel as ByteLevelProcessor
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = ByteLevelProcessor(trim_offsets=False)
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", bos_token=None)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return {s: tok.token_to_id(s) for s in SPECIALS}


def make_model(out_dir: str, *, hidden: int = 64, vision_scale: int = 1, seed: int = 0,
               max_side: int = 224) -> str:
    """Write the model into ``out_dir`` (created); returns ``out_dir``.

    Args:
        hidden: the text model's width = the row width of encoder outputs (bf16).
        vision_scale: widen and deepen the vision tower (encoder cost) by this factor.
        max_side: the largest image side (pixels) the processor keeps without downscaling.
    """
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    os.makedirs(out_dir, exist_ok=True)
    ids = _tokenizer(out_dir)
    vocab_size = 64 * ((max(ids.values()) + 1 + 63) // 64)
    heads = max(1, hidden // 32)  # head_dim 32: a size vLLM's CPU attention supports
    head_dim = hidden // heads
    section = [head_dim // 8, head_dim // 8 * 3 // 2, 0]
    section[2] = head_dim // 2 - section[0] - section[1]
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=4096, rms_norm_eps=1e-6,
                         bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": section},
                         tie_word_embeddings=False),
        vision_config=dict(depth=vision_scale, embed_dim=32 * vision_scale, hidden_size=hidden,
                           num_heads=2 * vision_scale, mlp_ratio=2, in_channels=3,
                           patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=2),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False)
    config.architectures = ["Qwen2VLForConditionalGeneration"]
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config)
    with torch.no_grad():  # larger than the default init, so that the image changes the tokens
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    model.to(torch.bfloat16).save_pretrained(out_dir)
    max_pixels = max_side * max_side
    common = {"min_pixels": FACTOR * FACTOR, "max_pixels": max_pixels, "patch_size": PATCH,
              "temporal_patch_size": 2, "merge_size": MERGE,
              "image_mean": [0.48145466, 0.4578275, 0.40821073],
              "image_std": [0.26862954, 0.26130258, 0.27577711],
              "size": {"shortest_edge": FACTOR * FACTOR, "longest_edge": max_pixels}}
    with open(os.path.join(out_dir, "preprocessor_config.json"), "w") as f:
        json.dump({"image_processor_type": "Qwen2VLImageProcessor",
                   "processor_class": "Qwen2VLProcessor", "do_resize": True, **common}, f)
    with open(os.path.join(out_dir, "video_preprocessor_config.json"), "w") as f:
        json.dump({"video_processor_type": "Qwen2VLVideoProcessor",
                   "processor_class": "Qwen2VLProcessor", **common}, f)
    with open(os.path.join(out_dir, "processor_config.json"), "w") as f:
        json.dump({"processor_class": "Qwen2VLProcessor"}, f)
    cfg_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(cfg_path) as f:
        tcfg = json.load(f)
    tcfg.update(processor_class="Qwen2VLProcessor", model_max_length=4096)
    with open(cfg_path, "w") as f:
        json.dump(tcfg, f)
    return out_dir


def make_image(i: int, side: int = 224):
    """Image ``i``: a deterministic, distinct RGB picture (PIL) of ``side × side`` pixels."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(1000 + i)
    base = rng.integers(0, 256, size=(side // 16, side // 16, 3), dtype=np.uint8)
    big = np.kron(base, np.ones((16, 16, 1), dtype=np.uint8))[:side, :side]
    return Image.fromarray(big, "RGB")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--vision-scale", type=int, default=1)
    ap.add_argument("--max-side", type=int, default=224)
    a = ap.parse_args()
    print(make_model(a.out_dir, hidden=a.hidden, vision_scale=a.vision_scale,
                     max_side=a.max_side))
