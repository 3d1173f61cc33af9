"""Build a full-size CosyVoice2 (or, `--family 3`, CosyVoice3) model directory with random weights, in the
official key layout.

Performance is measured on full-size random weights (same shapes, same cost as the real 0.5B model).
Weights are drawn like a trained model's init so fp16/bf16 activations stay finite: matrices
N(0, 1/fan_in), norms 1, biases small, weight-norm gains 1, Snake alphas 1; CosyVoice3's DiT rotary
`inv_freq` buffer holds its real values. Keys, shapes, the yaml and the Qwen2 config come from the golden
set's `full/` (../shared/golden, or ../shared/golden_cv3 for CosyVoice3). The text tokenizer is the
tiny golden one (its ids are valid rows of the full embedding); a voice `bench_voice` with a 6 s
prompt (150 speech tokens, 300 mel frames) is written to spk2info.pt (CosyVoice3's with the golden
speaker's prompt text: the system prefix + a transcript).

    python bench/full_model.py --out /tmp/cosyvoice2_full_bench     (about 2.3 GB, a minute on a GPU host)
    python bench/full_model.py --family 3 --out /tmp/cosyvoice3_full_bench --golden ../shared/golden_cv3

Never commit the output.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

import torch

GOLDEN = Path(__file__).resolve().parents[2] / "shared" / "golden"
GOLDEN3 = GOLDEN.with_name("golden_cv3")
# One directory for every benchmark, so that a GPU host builds it once (2.3 GB, about a minute).
DEFAULT_DIR = Path("/tmp/cosyvoice2_full_bench")
DEFAULT_DIR3 = Path("/tmp/cosyvoice3_full_bench")
ROTARY_BASE = 10_000  # x-transformers' RotaryEmbedding, as the official CosyVoice3 DiT builds it


def _random_tensor(key: str, shape: list[int], gen: torch.Generator) -> torch.Tensor:
    last = key.rsplit(".", 1)[-1]
    if last == "num_batches_tracked":
        return torch.zeros((), dtype=torch.long)
    if last in ("alpha", "original0") or (last == "weight" and len(shape) == 1):
        return torch.ones(shape)
    if last in ("running_var",):
        return torch.ones(shape)
    if last in ("bias", "running_mean"):
        return torch.randn(shape, generator=gen) * 0.01
    if last in ("pos_bias_u", "pos_bias_v"):
        return torch.randn(shape, generator=gen) * 0.02
    fan_in = math.prod(shape[1:]) if len(shape) > 1 else shape[0]
    std = 0.02 if "embed" in key else 1.0 / math.sqrt(fan_in)
    return torch.randn(shape, generator=gen) * std


def _weight(key: str, shape: list[int], gen: torch.Generator) -> torch.Tensor:
    if key.endswith("rotary_embed.inv_freq"):  # CosyVoice3's DiT: a buffer of fixed values, not a trained weight
        dim_head = 2 * shape[0]
        return 1.0 / ROTARY_BASE ** (torch.arange(0, dim_head, 2).float() / dim_head)
    return _random_tensor(key, shape, gen)


def _full_keys(golden: Path) -> dict[str, dict[str, list[int]]]:
    return json.loads((golden / "full" / "full_keys.json").read_text())


def full_part_state(part: str, golden: Path = GOLDEN, seed: int = 2026) -> dict[str, torch.Tensor]:
    """Random weights of one part ("llm", "flow", "hift") drawn on their own, for a benchmark of
    that part alone (build_full_model_dir draws the three from one generator, so they differ)."""
    gen = torch.Generator().manual_seed(seed)
    return {k: _random_tensor(k, shape, gen) for k, shape in _full_keys(golden)[part].items()}


def full_flow_on_meta(golden: Path = GOLDEN):
    """The full-size FlowModel built on the meta device from the official keys' shapes: nothing
    allocated, so its layout can be checked and its FLOPs counted on any machine."""
    from tts_core.flow import FlowModel
    from tts_core.flow.config import flow_config_from
    from tts_core.model_config import load_model_yaml

    state = {k: torch.empty(shape, device="meta") for k, shape in _full_keys(golden)["flow"].items()}
    cfg = flow_config_from(load_model_yaml(golden / "full" / "cosyvoice2_full.yaml"), state)
    with torch.device("meta"):
        return FlowModel(cfg).eval()


def full_speech_lm(golden: Path = GOLDEN, seed: int = 2026):
    """The full-size SpeechTokenLM (float32, CPU) with the very weights `build_full_model_dir` writes to
    llm.pt for the same seed (llm.pt is drawn first), built in memory: no 2.3 GB directory needed."""
    from tts_core.checkpoint import load_strict
    from tts_core.llm.qwen2 import Qwen2Config
    from tts_core.llm.speech_lm import SpeechTokenLM

    keys = _full_keys(golden)["llm"]
    gen = torch.Generator().manual_seed(seed)
    state = {k: _random_tensor(k, shape, gen) for k, shape in keys.items()}
    speech_token_size = keys["llm_decoder.weight"][0] - 3  # speech tokens, eos and two bistream ids
    lm = SpeechTokenLM(Qwen2Config.from_json(golden / "full" / "CosyVoice-BlankEN" / "config.json"), speech_token_size)
    load_strict(lm, state, "full_keys.json (random)")
    return lm.eval()


def build_full_model_dir(out: Path, golden: Path = GOLDEN, seed: int = 2026, prompt_tokens: int = 150,
                         family: int = 2) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    keys = _full_keys(golden)
    gen = torch.Generator().manual_seed(seed)
    for part in ("llm", "flow", "hift"):
        state = {k: _weight(k, shape, gen) for k, shape in keys[part].items()}
        torch.save(state, out / f"{part}.pt")
        print(f"wrote {part}.pt: {sum(v.numel() for v in state.values()) / 1e6:.1f} M parameters", flush=True)
    shutil.copy(golden / "full" / f"cosyvoice{family}_full.yaml", out / f"cosyvoice{family}.yaml")
    tiny = golden / f"cosyvoice{family}_tiny"
    qwen = out / "CosyVoice-BlankEN"
    qwen.mkdir(exist_ok=True)
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny / "CosyVoice-BlankEN" / name, qwen / name)
    shutil.copy(golden / "full" / "CosyVoice-BlankEN" / "config.json", qwen / "config.json")
    speech_tokens = torch.randint(0, 6561, (1, prompt_tokens), generator=gen, dtype=torch.int32)
    if family == 3:  # the CosyVoice3 prompt prefix: the golden speaker's prompt text carries it
        speaker = next(iter(torch.load(tiny / "spk2info.pt", weights_only=False).values()))
        prompt_text = speaker["prompt_text"]
    else:
        prompt_text = torch.randint(0, 500, (1, 20), generator=gen, dtype=torch.int32)
    voice = {
        "prompt_text": prompt_text, "prompt_text_len": torch.tensor([prompt_text.size(1)], dtype=torch.int32),
        "llm_prompt_speech_token": speech_tokens, "llm_prompt_speech_token_len": torch.tensor([prompt_tokens], dtype=torch.int32),
        "flow_prompt_speech_token": speech_tokens, "flow_prompt_speech_token_len": torch.tensor([prompt_tokens], dtype=torch.int32),
        "prompt_speech_feat": torch.randn((1, 2 * prompt_tokens, 80), generator=gen) * 2 - 6,
        "prompt_speech_feat_len": torch.tensor([2 * prompt_tokens], dtype=torch.int32),
        "llm_embedding": torch.randn((1, 192), generator=gen), "flow_embedding": torch.randn((1, 192), generator=gen),
    }
    torch.save({"bench_voice": voice}, out / "spk2info.pt")  # last: its presence means a whole build
    return out


def full_model_dir(out: Path | None = None, golden: Path | None = None, family: int = 2) -> Path:
    """`out` (default /tmp/cosyvoice<family>_full_bench), built first unless a whole build is already there
    (spk2info.pt is written last)."""
    out = out or (DEFAULT_DIR3 if family == 3 else DEFAULT_DIR)
    if not (out / "spk2info.pt").is_file():
        build_full_model_dir(out, golden or (GOLDEN3 if family == 3 else GOLDEN), family=family)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--family", type=int, choices=(2, 3), default=2, help="CosyVoice2 or CosyVoice3")
    parser.add_argument("--golden", type=Path, default=None, help="default ../shared/golden (family 3: golden_cv3)")
    parser.add_argument("--seed", type=int, default=2026)
    args = parser.parse_args(argv)
    build_full_model_dir(args.out, args.golden or (GOLDEN3 if args.family == 3 else GOLDEN), args.seed,
                         family=args.family)
    return 0


if __name__ == "__main__":
    sys.exit(main())
