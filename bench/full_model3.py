"""Build a full-size CosyVoice3 model directory with random weights, in the official key layout.

The sibling of bench/full_model.py (CosyVoice2) for `../shared/golden_cv3/full/`: every key and shape of
llm.pt, flow.pt and hift.pt from `full_keys.json`, drawn as full_model.py draws them (a trained model's
init, so fp16/bf16 activations stay finite), except the DiT's rotary `inv_freq` buffer, which holds its
real values. The yaml is the official full-size one; the text tokenizer is the tiny golden CosyVoice3 one
(its ids, special tokens included, are valid rows of the full embedding). A voice `bench_voice` with a 6 s
prompt (150 speech tokens, 300 mel frames) and the golden speaker's prompt text (the CosyVoice3 system prefix
+ a transcript) is written to spk2info.pt.

    python bench/full_model3.py --out /tmp/cosyvoice3_full_bench --golden ../shared/golden_cv3

Never commit the output.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from full_model import _full_keys, _random_tensor  # noqa: E402 - the sibling builder's weight draws

GOLDEN3 = Path(__file__).resolve().parents[2] / "shared" / "golden_cv3"
DEFAULT_DIR3 = Path("/tmp/cosyvoice3_full_bench")
ROTARY_BASE = 10_000  # x-transformers' RotaryEmbedding, as the official DiT builds it


def _weight(key: str, shape: list[int], gen: torch.Generator) -> torch.Tensor:
    if key.endswith("rotary_embed.inv_freq"):  # a buffer of fixed values, not a trained weight
        dim_head = 2 * shape[0]
        return 1.0 / ROTARY_BASE ** (torch.arange(0, dim_head, 2).float() / dim_head)
    return _random_tensor(key, shape, gen)


def build_full_model3_dir(out: Path, golden: Path = GOLDEN3, seed: int = 2026, prompt_tokens: int = 150) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    keys = _full_keys(golden)
    gen = torch.Generator().manual_seed(seed)
    for part in ("llm", "flow", "hift"):
        state = {k: _weight(k, shape, gen) for k, shape in keys[part].items()}
        torch.save(state, out / f"{part}.pt")
        print(f"wrote {part}.pt: {sum(v.numel() for v in state.values()) / 1e6:.1f} M parameters", flush=True)
    shutil.copy(golden / "full" / "cosyvoice3_full.yaml", out / "cosyvoice3.yaml")
    qwen = out / "CosyVoice-BlankEN"
    qwen.mkdir(exist_ok=True)
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(golden / "cosyvoice3_tiny" / "CosyVoice-BlankEN" / name, qwen / name)
    shutil.copy(golden / "full" / "CosyVoice-BlankEN" / "config.json", qwen / "config.json")
    speaker = next(iter(torch.load(golden / "cosyvoice3_tiny" / "spk2info.pt", weights_only=False).values()))
    speech_tokens = torch.randint(0, 6561, (1, prompt_tokens), generator=gen, dtype=torch.int32)
    tokens_len = torch.tensor([prompt_tokens], dtype=torch.int32)
    voice = {
        "prompt_text": speaker["prompt_text"], "prompt_text_len": speaker["prompt_text_len"],
        "llm_prompt_speech_token": speech_tokens, "llm_prompt_speech_token_len": tokens_len,
        "flow_prompt_speech_token": speech_tokens, "flow_prompt_speech_token_len": tokens_len,
        "prompt_speech_feat": torch.randn((1, 2 * prompt_tokens, 80), generator=gen) * 2 - 6,
        "prompt_speech_feat_len": torch.tensor([2 * prompt_tokens], dtype=torch.int32),
        "llm_embedding": torch.randn((1, 192), generator=gen), "flow_embedding": torch.randn((1, 192), generator=gen),
    }
    torch.save({"bench_voice": voice}, out / "spk2info.pt")  # last: its presence means a whole build
    return out


def full_model3_dir(out: Path = DEFAULT_DIR3, golden: Path = GOLDEN3) -> Path:
    """`out`, built first unless a whole build is already there (spk2info.pt is written last)."""
    if not (out / "spk2info.pt").is_file():
        build_full_model3_dir(out, golden)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--golden", type=Path, default=GOLDEN3)
    parser.add_argument("--seed", type=int, default=2026)
    args = parser.parse_args(argv)
    build_full_model3_dir(args.out, args.golden, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
