#!/usr/bin/env python3
"""Trains a DFlash block drafter for a target model Ferrite serves (by default the embedded
ferrite-code-20m) and writes it in z-lab's format (`DFlashDraftModel`), which
`crates/engine/src/models/dflash.rs` loads. Runs with MLX (third_party/venv): on this CPU for
a smoke run, on the GPU with the CUDA runtime for the real one.

What it learns: given the target's hidden states after `--taps` layers at every position
before an anchor (through `fc` and `hidden_norm`, the drafter's context) and a block of the
anchor token followed by mask tokens, the tokens the target would choose after the anchor —
the target's own argmax at each position of the text (self-distillation: acceptance is
agreement with the target, not with the text). Many blocks train at once: each sequence of
`--seq` tokens holds `--blocks` anchors; a block attends to the context before its anchor and
to itself (not causal), as at inference, where the drafter's cache holds the context. Loss:
cross-entropy at each mask position whose label is the target's own chain from the anchor
(`chain_kept`: on corpus text a label past the first token the target would not have chosen
answers text the drafter never sees), weighted exp(-(i - 1) / gamma) as the DFlash paper does
(early positions decide acceptance).

The target is frozen and run by mlx-lm; its embeddings and output head are the drafter's.
"""
import argparse
import json
import math
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.models.base import create_attention_mask, create_ssm_mask


class Attention(nn.Module):
    def __init__(self, h, heads, kv_heads, head_dim, eps):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(h, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(h, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(h, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, h, bias=False)
        self.q_norm = nn.RMSNorm(head_dim, eps=eps)
        self.k_norm = nn.RMSNorm(head_dim, eps=eps)


class Mlp(nn.Module):
    def __init__(self, h, inter):
        super().__init__()
        self.gate_proj = nn.Linear(h, inter, bias=False)
        self.up_proj = nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)

    def __call__(self, x):
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, h, heads, kv_heads, head_dim, inter, eps):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(h, eps=eps)
        self.self_attn = Attention(h, heads, kv_heads, head_dim, eps)
        self.post_attention_layernorm = nn.RMSNorm(h, eps=eps)
        self.mlp = Mlp(h, inter)


def rope(x, positions, theta):
    """Rotates halves (MLX's `traditional=False`): x [N, heads, L, d], positions [N, L]."""
    d = x.shape[-1]
    inv = theta ** (-mx.arange(0, d, 2, dtype=mx.float32) / d)
    angles = positions[:, None, :, None].astype(mx.float32) * inv
    cos, sin = mx.cos(angles), mx.sin(angles)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return mx.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


class Drafter(nn.Module):
    def __init__(self, h, taps, layers, heads, kv_heads, head_dim, inter, eps, theta):
        super().__init__()
        self.theta = theta
        self.fc = nn.Linear(taps * h, h, bias=False)
        self.hidden_norm = nn.RMSNorm(h, eps=eps)
        self.layers = [Layer(h, heads, kv_heads, head_dim, inter, eps) for _ in range(layers)]
        self.norm = nn.RMSNorm(h, eps=eps)

    def __call__(self, taps, x, ctx_pos, blk_pos, mask):
        """taps [N, T, taps·H]; x [N, KB, H] the blocks' embeddings; positions; mask [N, 1, KB, T+KB]."""
        ctx = self.hidden_norm(self.fc(taps))
        n, kb = x.shape[0], x.shape[1]
        key_pos = mx.concatenate([ctx_pos, blk_pos], axis=1)
        for layer in self.layers:
            a = layer.self_attn
            h = layer.input_layernorm(x)
            both = mx.concatenate([ctx, h], axis=1)
            q = a.q_norm(a.q_proj(h).reshape(n, kb, a.heads, a.head_dim)).transpose(0, 2, 1, 3)
            k = a.k_norm(a.k_proj(both).reshape(n, -1, a.kv_heads, a.head_dim)).transpose(0, 2, 1, 3)
            v = a.v_proj(both).reshape(n, -1, a.kv_heads, a.head_dim).transpose(0, 2, 1, 3)
            q, k = rope(q, blk_pos, self.theta), rope(k, key_pos, self.theta)
            o = mx.fast.scaled_dot_product_attention(q, k, v, scale=a.head_dim ** -0.5, mask=mask)
            x = x + a.o_proj(o.transpose(0, 2, 1, 3).reshape(n, kb, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)


def text_model(model):
    """mlx-lm's inner text model (embeddings, layers) and its output head."""
    outer = getattr(model, "language_model", model)
    inner = outer.model
    tied = getattr(outer, "args", None) is None or outer.args.tie_word_embeddings
    head = inner.embed_tokens.as_linear if tied else outer.lm_head
    return inner, head


def target_pass(inner, head, ids, taps):
    """The target over ids [N, T]: its layers `taps` concatenated, and its argmax tokens."""
    h = inner.embed_tokens(ids)
    fa_mask = create_attention_mask(h, None)
    ssm_mask = create_ssm_mask(h, None)
    tapped = {}
    for i, layer in enumerate(inner.layers):
        h = layer(h, mask=ssm_mask if getattr(layer, "is_linear", False) else fa_mask, cache=None)
        if i in taps:
            tapped[i] = h
    greedy = mx.argmax(head(inner.norm(h)), axis=-1)
    return mx.stop_gradient(mx.concatenate([tapped[i] for i in taps], axis=-1)), greedy


def blocks(rng, n, t, k, b, first):
    """K anchors a sequence, at distinct positions in [first, T - B] (`first`: [N], each row's
    own): [N, K]."""
    return np.stack([np.sort(rng.choice(np.arange(f, t - b + 1), size=k, replace=False)) for f in first])


def chain_kept(ids, greedy, anchors, b):
    """[N, K, B-1] numpy bools: where a drafted position's label is the target's own chain.

    The label at block position i is the target's choice after the text up to anchor + i - 1.
    At inference the tokens after the anchor are the target's own earlier choices, so that
    label is the one a drafter must predict only where the text took each of them too: every
    position of the target's own text past its prompt, about half the corpus' second
    positions. Elsewhere the label answers text the drafter never sees (its inputs there are
    mask tokens), and training on it teaches the corpus' continuation, not the target's.
    """
    n, k = anchors.shape
    pos = (anchors[:, :, None] + np.arange(1, b - 1)).reshape(n, -1)  # anchor + 1 .. anchor + b - 2
    took = np.take_along_axis(ids, pos, axis=1) == np.take_along_axis(greedy, pos - 1, axis=1)
    chain = np.cumprod(took.reshape(n, k, b - 2), axis=2).astype(bool)
    return np.concatenate([np.ones((n, k, 1), dtype=bool), chain], axis=2)


def batch_inputs(ids, greedy, anchors, b, mask_token, embed):
    """The blocks' embeddings, positions, attention mask, labels (the target's choice at each
    drafted position) and which labels are the target's own chain (`chain_kept`)."""
    n, t = ids.shape
    k = anchors.shape[1]
    offs = np.arange(b)
    pos = anchors[:, :, None] + offs  # [N, K, B]: each block position's place in the text
    blk_ids = np.full((n, k, b), mask_token, dtype=np.int32)
    ids_np, greedy_np = np.array(ids), np.array(greedy)
    blk_ids[:, :, 0] = np.take_along_axis(ids_np, anchors, axis=1)
    # The target at position p - 1 chose the token at p.
    labels = np.take_along_axis(greedy_np, (pos[:, :, 1:] - 1).reshape(n, -1), axis=1).reshape(n, k, b - 1)
    # Block rows see the context before their anchor and their own block.
    ctx_keep = np.arange(t)[None, None, :] < anchors[:, :, None]  # [N, K, T]
    ctx_keep = np.repeat(ctx_keep, b, axis=1)  # [N, K·B, T]
    own = np.kron(np.eye(k, dtype=bool), np.ones((b, b), dtype=bool))  # [K·B, K·B]
    keep = np.concatenate([ctx_keep, np.broadcast_to(own, (n, k * b, k * b))], axis=2)
    x = embed(mx.array(blk_ids.reshape(n, k * b)))
    return (
        x,
        mx.array(np.broadcast_to(np.arange(t), (n, t)).astype(np.int32)),
        mx.array(pos.reshape(n, k * b).astype(np.int32)),
        mx.array(keep[:, None]),
        mx.array(labels.astype(np.int32)),
        mx.array(chain_kept(ids_np, greedy_np, anchors, b).astype(np.float32)),
    )


def loss_fn(drafter, head, taps, x, ctx_pos, blk_pos, mask, labels, kept, b, gamma):
    """The weighted cross-entropy over kept labels, and the hits (a label not kept is a miss:
    on corpus text the accepted lengths are a lower bound, on the target's own text exact)."""
    n, k = labels.shape[0], labels.shape[1]
    out = drafter(taps, x, ctx_pos, blk_pos, mask).reshape(n, k, b, -1)[:, :, 1:]
    logits = head(out).astype(mx.float32)
    ce = nn.losses.cross_entropy(logits, labels, reduction="none")  # [N, K, B-1]
    w = mx.exp(-mx.arange(b - 1, dtype=mx.float32) / gamma) * kept
    hits = (mx.argmax(logits, axis=-1) == labels).astype(mx.float32) * kept
    return (ce * w).sum() / w.sum(), hits


def read_ids(path):
    return np.fromfile(path, dtype="<u2").astype(np.int32)


def sample_batch(rng, data, n, t):
    starts = rng.integers(0, len(data) - t - 1, size=n)
    return mx.array(np.stack([data[s : s + t] for s in starts]))


def read_rows(path, t):
    """train/generate.py's rows (u16 ids, `t` a row), or None where there is no such file."""
    if not path.exists():
        return None
    ids = read_ids(path)
    if len(ids) < t or len(ids) % t:
        raise SystemExit(f"{path}: {len(ids)} ids are not rows of {t} (written with another --seq?)")
    return ids.reshape(-1, t)


def sample_rows(rng, rows, n):
    return mx.array(rows[rng.integers(0, len(rows), size=n)])


def accept_lengths(hits):
    """Accepted drafts a block (a run of hits from the first position), as numpy."""
    h = np.array(hits).reshape(-1, hits.shape[-1])
    return np.cumprod(h, axis=1).sum(axis=1)


def cycle_lengths(accepted):
    """The tokens each cycle of greedy decoding commits along one row, given `accepted` [P]:
    the drafts a block anchored at each place (one apart, the first where decoding drafts
    first) would have accepted. A cycle commits its accepted drafts and the target's own next
    token, and the next cycle is anchored at that token."""
    lengths, place = [], 0
    while place < len(accepted):
        lengths.append(int(accepted[place]) + 1)
        place += lengths[-1]
    return lengths


def first_drafted_place(made):
    """Where decoding drafts first in train/generate.py's rows: their prompt's last token (the
    prompt's length from the `.json` beside them)."""
    return max(1, json.loads(made.read_text())["prompt"] - 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, default=Path("assets/models/ferrite-code-20m"))
    ap.add_argument("--data", type=Path, default=Path("train/data"),
                    help="train.bin and heldout.bin (u16 ids); train-generated.bin and heldout-generated.bin"
                         " (train/generate.py's rows) where present")
    ap.add_argument("--generated-share", type=float, default=0.5,
                    help="the share of each batch's rows taken from train-generated.bin, where it exists")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--taps", default="1,3,5,7", help="the target's layers the drafter reads")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=32, help="anchors a sequence")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init", type=Path, help="a drafter this script wrote, to train further")
    ap.add_argument("--minutes", type=float, default=0,
                    help="a time budget: the schedule shrinks to the steps that fit (0: --steps)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16",
                    help="the written tensors' type (the engine computes in the target's)")
    ap.add_argument("--eval-only", action="store_true", help="evaluate --init's drafter and stop")
    ap.add_argument("--anchors-anywhere", action="store_true",
                    help="anchor blocks of the target's own rows in their corpus prompt too (by default from the"
                         " prompt's last token on, where inference drafts)")
    args = ap.parse_args()

    mx.random.seed(args.seed)
    rng = np.random.default_rng(args.seed)
    model, _ = load(str(args.target))
    model.freeze()
    inner, head = text_model(model)
    tc = json.loads((args.target / "config.json").read_text())
    tc = tc.get("text_config", tc)
    h, vocab = tc["hidden_size"], tc["vocab_size"]
    theta = tc.get("rope_parameters", {}).get("rope_theta", tc.get("rope_theta", 1e6))
    taps = [int(t) for t in args.taps.split(",")]
    b = args.block_size
    mask_token = vocab - 1
    drafter = Drafter(h, len(taps), args.layers, tc["num_attention_heads"], tc["num_key_value_heads"],
                      tc.get("head_dim", h // tc["num_attention_heads"]), tc["intermediate_size"],
                      tc["rms_norm_eps"], theta)
    if args.init:
        saved = mx.load(str(args.init / "model.safetensors"))
        drafter.load_weights([(k, v.astype(mx.float32)) for k, v in saved.items()])
    params = sum(v.size for _, v in tree_flatten(drafter.parameters()))
    print(f"drafter: {args.layers} layers, {params / 1e6:.2f}M parameters, blocks of {b}, taps {taps}", flush=True)

    train, heldout = read_ids(args.data / "train.bin"), read_ids(args.data / "heldout.bin")
    train_rows = read_rows(args.data / "train-generated.bin", args.seq)
    heldout_rows = read_rows(args.data / "heldout-generated.bin", args.seq)
    generated = 0 if train_rows is None else round(args.batch * args.generated_share)
    # At inference the first block's anchor is the prompt's last token and every later one is
    # a token the target chose: a block anchored inside a corpus prompt drafts what the
    # drafter never has to.
    made = args.data / "train-generated.json"
    answer_from = 1
    if train_rows is not None and not args.anchors_anywhere:
        if not made.exists():
            raise SystemExit(f"{made} is missing: it says how long the generated rows' prompt is (where their"
                             " blocks are anchored); carry it with train-generated.bin, or pass --anchors-anywhere")
        answer_from = first_drafted_place(made)
    # Decoding drafts first at the held-out rows' prompt's last token, however training anchors.
    made_heldout = args.data / "heldout-generated.json"
    path_from = first_drafted_place(made_heldout) if made_heldout.exists() else answer_from
    if args.seq - b + 1 - answer_from < args.blocks:
        raise SystemExit(f"--blocks {args.blocks} do not fit the {args.seq - b + 1 - answer_from} anchor places"
                         f" from the generated rows' position {answer_from} on")
    print(f"rows a batch: {args.batch - generated} of corpus text, {generated} the target wrote", flush=True)
    # The steps to run: --steps, or fewer once the first steps' pace shows what fits the budget.
    total = [args.steps]

    def schedule(step):
        # Linear warm-up, then a cosine decay to a tenth over the steps that will run.
        s = step.item() if isinstance(step, mx.array) else step
        if s < args.warmup:
            return mx.array(1e-7 + (args.lr - 1e-7) * s / args.warmup)
        frac = min(1.0, (s - args.warmup) / max(1, total[0] - args.warmup))
        return mx.array(args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))))

    opt = optim.AdamW(learning_rate=schedule, betas=[0.9, 0.95], weight_decay=0.01)
    gamma = max(b / 2, 1.0)
    step_fn = nn.value_and_grad(drafter, lambda d, *a: loss_fn(d, head, *a, b, gamma))

    def batch(data, n, rows=None, from_rows=0):
        parts = [sample_batch(rng, data, n - from_rows, args.seq)] if from_rows < n else []
        if from_rows:
            parts.append(sample_rows(rng, rows, from_rows))
        ids = mx.concatenate(parts) if len(parts) > 1 else parts[0]
        t, greedy = target_pass(inner, head, ids, taps)
        first = np.array([1] * (n - from_rows) + [answer_from] * from_rows)
        anchors = blocks(rng, n, args.seq, args.blocks, b, first)
        return (t, *batch_inputs(ids, greedy, anchors, b, mask_token, inner.embed_tokens))

    def evaluate_on(data):
        eval_rng_state = rng.bit_generator.state
        lengths, losses = [], []
        for _ in range(8):
            args_ = batch(data, args.batch)
            loss, hits = loss_fn(drafter, head, *args_, b, gamma)
            losses.append(loss.item())
            lengths.append(accept_lengths(hits))
        rng.bit_generator.state = eval_rng_state
        accepted = np.concatenate(lengths)
        return float(np.mean(losses)), float(accepted.mean()) + 1.0

    def evaluate_rows(rows):
        """The target's own held-out rows, a block at every place from the prompt's last token
        on: loss, teacher-forced tokens per block, and tokens a cycle on decoding's path (each
        row's cycles followed, `cycle_lengths`). Decoding anchors where the last block failed,
        at harder places than the average one, so the last is below the teacher-forced figure,
        and it is what `ferrite bench --spec` measures."""
        places = np.arange(path_from, args.seq - b + 1)
        chunk = max(1, 4096 // (len(places) * b))  # block tokens a forward pass
        losses, per_block, cycles = [], [], []
        for start in range(0, len(rows), chunk):
            ids = mx.array(rows[start : start + chunk])
            t, greedy = target_pass(inner, head, ids, taps)
            anchors = np.broadcast_to(places, (ids.shape[0], len(places))).copy()
            loss, hits = loss_fn(drafter, head, t, *batch_inputs(ids, greedy, anchors, b, mask_token, inner.embed_tokens),
                                 b, gamma)
            losses.append(loss.item())
            accepted = accept_lengths(hits)
            per_block.append(accepted)
            cycles += [n for row in accepted.reshape(ids.shape[0], len(places)) for n in cycle_lengths(row)]
        return float(np.mean(losses)), float(np.concatenate(per_block).mean()) + 1.0, sum(cycles) / len(cycles)

    def evaluate(step):
        """Prints the held-out figures; returns tokens a cycle on decoding's path over the
        target's own held-out rows where there are some (what `ferrite bench --spec`
        measures), else teacher-forced tokens per block on corpus text."""
        held_loss, per_cycle = evaluate_on(heldout)
        line = f"step {step}: held-out loss {held_loss:.3f}, teacher-forced tokens per block {per_cycle:.2f}"
        if heldout_rows is not None:
            gen_loss, gen_block, per_cycle = evaluate_rows(heldout_rows)
            line += (f"; on the target's own text: loss {gen_loss:.3f}, tokens per block {gen_block:.2f},"
                     f" tokens a cycle on decoding's path {per_cycle:.2f}")
        print(line, flush=True)
        return per_cycle

    if args.eval_only:
        evaluate(0)
        return

    # The drafter is written at each evaluation that beats the best so far (the one it
    # started from included), so many passes over a small generated set cannot leave a
    # drafter worse on held-out text than an earlier one.
    best, best_step = (evaluate(0) if args.init else 0.0), None

    started = time.time()
    step = 0
    while step < total[0]:
        step += 1
        (loss, _), grads = step_fn(drafter, *batch(train, args.batch, train_rows, generated))
        opt.update(drafter, grads)
        mx.eval(drafter.parameters(), opt.state, loss)
        if step == 25:
            warm = time.time()  # the first steps compile kernels: pace is timed after them
        if step == 75 and args.minutes > 0:
            # Evaluations cost about 8 steps a held-out set: leave them room.
            pace = (time.time() - warm) / 50
            fits = int((args.minutes * 60 - (warm - started)) / pace) + 25
            per_eval = 8 * (1 if heldout_rows is None else 2)
            total[0] = max(step + 1, min(args.steps, fits - per_eval * (fits // args.eval_every + 1)))
            print(f"{pace * 1000:.0f} ms a step: {total[0]} steps fit {args.minutes} minutes", flush=True)
        if step % 25 == 0:
            print(f"step {step}: loss {loss.item():.3f} ({time.time() - started:.0f} s)", flush=True)
        if step % args.eval_every == 0 or step == total[0]:
            per_cycle = evaluate(step)
            # Written as it goes, so a run stopped early leaves its best drafter.
            if per_cycle > best:
                best, best_step = per_cycle, step
                write(args.out, drafter, tc, taps, b, mask_token, args.layers, args.dtype)
                print(f"wrote {args.out} (step {step}: {per_cycle:.2f} tokens per block)", flush=True)

    if best_step is None:
        print(f"{step} steps, {time.time() - started:.0f} s: no evaluation beat --init's {best:.2f}; nothing written")
    else:
        print(f"wrote {args.out} at step {best_step} of {step}, {time.time() - started:.0f} s")


def write(out, drafter, tc, taps, b, mask_token, layers, dtype="float32"):
    """The drafter as z-lab publishes one: its tensors, a Qwen3 config with dflash_config."""
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(getattr(mx, dtype)) for k, v in tree_flatten(drafter.parameters())}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    h = tc["hidden_size"]
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": h,
        "num_hidden_layers": layers,
        "num_attention_heads": tc["num_attention_heads"],
        "num_key_value_heads": tc["num_key_value_heads"],
        "head_dim": tc.get("head_dim", h // tc["num_attention_heads"]),
        "intermediate_size": tc["intermediate_size"],
        "hidden_act": "silu",
        "rms_norm_eps": tc["rms_norm_eps"],
        "rope_theta": drafter.theta,
        "vocab_size": tc["vocab_size"],
        "max_position_embeddings": tc.get("max_position_embeddings", 32768),
        "tie_word_embeddings": False,
        "attention_bias": False,
        "is_causal": False,
        "block_size": b,
        "num_target_layers": tc["num_hidden_layers"],
        "layer_types": ["full_attention"] * layers,
        "dflash_config": {"mask_token_id": mask_token, "target_layer_ids": taps},
        "torch_dtype": dtype,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


if __name__ == "__main__":
    main()
