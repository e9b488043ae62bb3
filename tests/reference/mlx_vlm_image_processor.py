"""What mlx-vlm's Qwen3-VL / Qwen3.5 image processor makes of image files, for the parity test
of Ferrite's processor (crates/engine/tests/vision.rs). Each file is opened with Pillow as
mlx-vlm opens it; the processor takes the settings of --config (a preprocessor_config.json).
Writes, per image, `<out>/<i>.f32` (pixel_values, little-endian f32) and `<out>/grids.json`."""
import argparse
import json
from pathlib import Path

import numpy as np
from mlx_vlm.models.qwen3_vl.processing_qwen3_vl import Qwen3VLImageProcessor, _qwen_vl_image_kwargs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", type=Path, required=True, help="a folder with preprocessor_config.json")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("images", type=Path, nargs="+")
    args = ap.parse_args()
    processor = Qwen3VLImageProcessor(**_qwen_vl_image_kwargs(str(args.checkpoint)))
    grids = []
    for i, path in enumerate(args.images):
        # fetch_images opens the file with Pillow and converts it to RGB, as a request's image.
        out = processor(processor.fetch_images([str(path)]))
        np.asarray(out["pixel_values"], dtype="<f4").tofile(args.out / f"{i}.f32")
        grids.append([int(x) for x in out["image_grid_thw"][0]])
    (args.out / "grids.json").write_text(json.dumps(grids))


if __name__ == "__main__":
    main()
