"""The MRoPE positions and angles mlx-vlm 0.7.10 gives a Qwen3.5 prompt with images, for the
parity test of Ferrite's (crates/engine/tests/vision.rs). Reads one JSON object on stdin —
tokens, grids (the vision tower's, before the spatial merge), merge, image_token,
vision_start, dims, base, section — and prints {positions: [3][L], delta, angles: [L][dims/2]}."""
import json
import sys
from types import SimpleNamespace

import mlx.core as mx
from mlx_vlm.models.qwen3_5.language import LanguageModel
from mlx_vlm.models.rope_utils import compute_inv_freq, compute_mrope_frequencies


def main():
    a = json.load(sys.stdin)
    config = SimpleNamespace(
        vision_config=SimpleNamespace(spatial_merge_size=a["merge"]),
        image_token_id=a["image_token"],
        video_token_id=a["image_token"] + 1,
        vision_start_token_id=a["vision_start"],
    )
    tokens = mx.array([a["tokens"]], dtype=mx.int32)
    positions, delta = LanguageModel.get_rope_index(
        SimpleNamespace(config=config), tokens, mx.array(a["grids"], dtype=mx.int32)
    )
    freqs = compute_mrope_frequencies(
        positions, compute_inv_freq(a["dims"], a["base"]), a["section"], style="interleaved"
    )
    print(json.dumps({
        "positions": positions[:, 0, :].tolist(),
        "delta": int(delta.reshape(-1)[0].item()),
        "angles": freqs.reshape(len(a["tokens"]), -1).tolist(),
    }))


if __name__ == "__main__":
    main()
