"""`mlx_lm.server` as bench/clients.sh runs it.

The project-made hybrid checkpoints carry an MTP head (`mtp.*` tensors). mlx-lm 0.32.0's
qwen3_next model had no module for it and its strict load refused the file (the server's
generation thread died and `/health` answered 503 for ever), so the weights are loaded with
`strict=False`: the head is ignored, as mlx-lm ignores it in a real checkpoint (0.32.2's
`sanitize` drops `mtp.*` itself; the non-strict load stays harmless).
    python bench/mlx_lm_server.py --model DIR --port N   (mlx_lm.server's own arguments)
"""

import functools
import sys

import mlx_lm.utils as utils

utils.load_model = functools.partial(utils.load_model, strict=False)

from mlx_lm.server import main  # noqa: E402  (after the patch: it binds utils.load_model late)

if __name__ == "__main__":
    sys.argv[0] = "mlx_lm.server"
    main()
