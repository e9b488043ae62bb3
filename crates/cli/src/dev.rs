use std::path::PathBuf;

use anyhow::{bail, Result};
use engine::checkpoint::drafter::{make_drafter, spread_taps, DrafterOptions};
use engine::checkpoint::{self, Architecture, Dtype, Layout, MakeOptions};

#[derive(clap::Subcommand)]
pub enum Command {
    /// Write a random-initialised checkpoint in the MLX layout, with a trained tokenizer.
    MakeCheckpoint(MakeArgs),
    /// Write a random-initialised DFlash block drafter in z-lab's format for the checkpoint in
    /// --target (what `--drafter` loads): a real drafter's shape beside a made target, whose
    /// verify passes and block passes can then be timed (acceptance is not the point).
    MakeDrafter {
        #[arg(long)]
        target: PathBuf,
        #[arg(long, default_value_t = 1)]
        layers: i32,
        #[arg(long, default_value_t = 8)]
        block_size: usize,
        /// Target layers it reads (comma-separated); default: spread as z-lab spreads them.
        #[arg(long, value_delimiter = ',')]
        taps: Vec<usize>,
        /// The MLPs' width (default: twice the hidden size).
        #[arg(long)]
        intermediate_size: Option<i32>,
        #[command(flatten)]
        tensors: TensorArgs,
        #[arg(long)]
        out: PathBuf,
    },
    /// Train a byte-level BPE tokenizer (Ferrite's special tokens and chat template) on the
    /// documents of a JSONL file (`{"text": ...}` per line); writes tokenizer.json and
    /// tokenizer_config.json into OUT.
    TrainTokenizer {
        #[arg(long)]
        docs: PathBuf,
        #[arg(long, default_value_t = 8192)]
        vocab: usize,
        #[arg(long)]
        out: PathBuf,
    },
    /// Tokenize the documents of a JSONL file into little-endian u16 ids, each document
    /// followed by <|endoftext|>; prints the token count.
    Tokenize {
        /// Folder holding tokenizer.json.
        #[arg(long)]
        tokenizer: PathBuf,
        #[arg(long)]
        docs: PathBuf,
        #[arg(long)]
        out: PathBuf,
    },
    /// Held-out perplexity by position: the files' text (concatenated, in the order given) as
    /// one document of at most --tokens tokens, run through the model in prefill chunks; prints
    /// the perplexity of each --window positions (quality past the trained context).
    Perplexity {
        #[arg(long)]
        model: PathBuf,
        /// Text files (repeatable).
        #[arg(long, required = true)]
        text: Vec<PathBuf>,
        #[arg(long, default_value_t = 32768)]
        tokens: usize,
        /// Start this many tokens into the text (the same tokens measured at another position).
        #[arg(long, default_value_t = 0)]
        skip: usize,
        #[arg(long, default_value_t = 4096)]
        window: usize,
        #[arg(long, default_value_t = 2048)]
        chunk: usize,
    },
    /// Count the MLX operations one greedy decode step dispatches, by kind, after prompts of
    /// the given lengths (compare: `bench/mlx_lm_ops.py` for mlx-lm on the same folder).
    Ops {
        /// Model folder.
        #[arg(long)]
        model: PathBuf,
        /// Prompt lengths before the counted step (repeatable).
        #[arg(long, default_values_t = [128usize])]
        context: Vec<usize>,
        /// Also time a prompt of this many tokens in one pass, layer part by layer part.
        #[arg(long)]
        prefill: Option<usize>,
        /// Positions a step takes: 1 is a decode step, more a verify pass's (repeatable).
        #[arg(long, default_values_t = [1usize])]
        positions: Vec<usize>,
        /// One JSON object per context instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Decode speed of several sequences stepped together against one alone (interleaved
    /// rounds; one JSON line per stream count).
    Batch {
        #[arg(long)]
        model: PathBuf,
        /// Stream counts (comma-separated).
        #[arg(long, value_delimiter = ',', default_values_t = [1usize, 2, 4, 8])]
        streams: Vec<usize>,
        /// Tokens each stream generates.
        #[arg(long, default_value_t = 64)]
        tokens: usize,
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// Instead: one stream decodes while a newcomer with a prompt of this many tokens
        /// joins; its prefill interleaved at each of `--interleave` tokens a step.
        #[arg(long)]
        join_prompt: Option<usize>,
        /// Newcomer prompt tokens prefilled per step (0: the whole prompt in one step).
        #[arg(long, value_delimiter = ',', default_values_t = [0usize, 1024, 512, 256, 128])]
        interleave: Vec<usize>,
    },
    /// Joins the distributed group the environment describes (`MLX_RANK`, `MLX_HOSTFILE`, as
    /// `mlx.launch` sets them) and prints this rank's all_sum and all_gather (one JSON line).
    Collectives {
        #[arg(long, default_value = "ring")]
        backend: String,
        #[arg(long, default_value_t = 1)]
        rounds: usize,
        /// Ranks other than 0 are killed (SIGKILL, no clean-up) after this many rounds: what
        /// the others see of a rank that dies.
        #[arg(long)]
        die_after: Option<usize>,
        /// Ranks other than 0 stop answering (alive, silent) after this many rounds: what the
        /// others see of a rank that hangs.
        #[arg(long)]
        stall_after: Option<usize>,
    },
    /// The runtime depth controller against a fixed draft depth and plain decoding on a fixed
    /// answer of held-out code then prose (one JSON line per setting).
    Depth {
        #[arg(long)]
        model: PathBuf,
        /// JSON array of token-id arrays: the code part (held-out code in the model's tokenizer).
        #[arg(long)]
        code_ids: PathBuf,
        #[arg(long, default_value_t = 400)]
        code_tokens: usize,
        /// A text file: the prose part.
        #[arg(long)]
        prose: PathBuf,
        /// The fixed depth, and the controller's starting one.
        #[arg(long, default_value_t = 2)]
        depth: usize,
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// A block drafter's folder: it drafts in place of the MTP head.
        #[arg(long)]
        drafter: Option<PathBuf>,
    },
    /// Times a whole prompt with one picture of --width x --height on the checkpoint in
    /// --model (a text model that sees): --text synthetic tokens around the picture's markup,
    /// to the first token (its preprocessing, tower and prefill), fresh each of --runs times
    /// after a warm-up; one JSON line (bench/vision_prefill.sh).
    VisionPrefill {
        #[command(flatten)]
        picture: crate::vision::PictureArgs,
        #[arg(long, default_value_t = 64)]
        text: usize,
        /// Writes the prompt's token ids as the model reads them (the image token repeated
        /// for the picture's size) here, as JSON.
        #[arg(long)]
        tokens_out: Option<PathBuf>,
    },
    /// Times the vision tower of the checkpoint in --model on a picture of --width x
    /// --height (as the model's processor cuts it): one JSON line with the seconds of each of
    /// --runs passes after a warm-up (bench/vision.sh).
    VisionTower(crate::vision::PictureArgs),
}

/// The `text` of every line of a JSONL file.
fn read_docs(path: &std::path::Path) -> Result<Vec<String>> {
    use anyhow::Context;
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            let v: serde_json::Value =
                serde_json::from_str(l).with_context(|| format!("{}:{}: not JSON", path.display(), i + 1))?;
            v.get("text")
                .and_then(|t| t.as_str())
                .map(str::to_string)
                .with_context(|| format!("{}:{}: no string `text`", path.display(), i + 1))
        })
        .collect()
}

fn train_tokenizer(docs: &std::path::Path, vocab: usize, out: &std::path::Path) -> Result<()> {
    let docs = read_docs(docs)?;
    std::fs::create_dir_all(out)?;
    let n = checkpoint::tokenizer_trainer::train_tokenizer(&out.join("tokenizer.json"), vocab, docs.into_iter())?;
    checkpoint::write_tokenizer_config(out)?;
    println!("{}: {n} tokens in the vocabulary", out.display());
    Ok(())
}

fn tokenize(tokenizer: &std::path::Path, docs: &std::path::Path, out: &std::path::Path) -> Result<()> {
    let tok = engine::tokenizer::Tokenizer::load(tokenizer)?;
    let end = tok.token_id("<|endoftext|>").ok_or_else(|| anyhow::anyhow!("the tokenizer has no <|endoftext|>"))?;
    let mut bytes = Vec::new();
    let mut count = 0usize;
    for doc in read_docs(docs)? {
        for id in tok.encode(&doc)?.into_iter().chain([end]) {
            let id = u16::try_from(id).map_err(|_| anyhow::anyhow!("token id {id} does not fit in u16"))?;
            bytes.extend_from_slice(&id.to_le_bytes());
            count += 1;
        }
    }
    std::fs::write(out, bytes)?;
    println!("{}: {count} tokens", out.display());
    Ok(())
}

fn ops(
    model: &std::path::Path,
    contexts: &[usize],
    positions: &[usize],
    prefill: Option<usize>,
    json: bool,
) -> Result<()> {
    use anyhow::Context;
    let engine = engine::Engine::load_with(model, &server::engine_options::from_env(engine::Profile::default(), None)?)
        .with_context(|| format!("loading {}", model.display()))?;
    if let Some(tokens) = prefill {
        let t = engine::graph::prefill_times(&engine, tokens)?;
        if json {
            println!(
                "{}",
                serde_json::json!({"engine": "ferrite", "prefill_tokens": t.tokens, "total_ms": t.total_ms, "by_part": t.by_part, "before_mb": t.before_mb, "peak_mb_by_part": t.peak_mb_by_part, "laps": t.laps})
            );
        } else {
            println!(
                "{}: a {}-token prompt in one pass, each layer part waited for: {:.1} ms ({:.0} MB in use before it)",
                model.display(),
                t.tokens,
                t.total_ms,
                t.before_mb
            );
            for (part, ms) in &t.by_part {
                let peak = t.peak_mb_by_part.get(part).copied().unwrap_or(0.0);
                println!("  {ms:>9.1} ms  peak {peak:>9.0} MB  {part}");
                for (lap, ms) in t.laps.iter().filter(|(lap, _)| lap.starts_with(&format!("{part}: "))) {
                    println!("  {ms:>9.1} ms  {:>14}    {lap}", "");
                }
            }
        }
    }
    for (&context, &positions) in contexts.iter().flat_map(|c| positions.iter().map(move |p| (c, p))) {
        let ops = engine::graph::decode_step_ops(&engine, context, positions)?;
        if json {
            println!(
                "{}",
                serde_json::json!({"engine": "ferrite", "context": context, "positions": positions, "total": ops.total, "by_kind": ops.by_kind, "build_ms": ops.build_ms, "step_ms": ops.step_ms})
            );
            continue;
        }
        let what = match positions {
            1 => "one decode step".to_string(),
            n => format!("one verify pass of {n} positions"),
        };
        println!(
            "{}: {what} after {context} tokens: {} operations; built in {:.2} ms, {:.2} ms built and run alone",
            model.display(),
            ops.total,
            ops.build_ms,
            ops.step_ms
        );
        let mut kinds: Vec<_> = ops.by_kind.iter().collect();
        kinds.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
        for (kind, n) in kinds {
            println!("  {n:>6}  {kind}");
        }
    }
    Ok(())
}

/// How made tensors are stored (checkpoints and drafters alike).
#[derive(clap::Args)]
pub struct TensorArgs {
    /// Quantize matrices to this many bits (2, 3, 4, 5, 6, 8); omit for floating point.
    #[arg(long)]
    bits: Option<i32>,
    #[arg(long, default_value_t = 64)]
    group_size: i32,
    /// Floating-point type of unquantized weights and of scales: f32, bf16, f16.
    #[arg(long, default_value = "bf16")]
    dtype: String,
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

impl TensorArgs {
    fn apply(&self, opts: &mut MakeOptions) -> Result<()> {
        (opts.bits, opts.group_size, opts.dtype, opts.seed) =
            (self.bits, self.group_size, parse_dtype(&self.dtype)?, self.seed);
        Ok(())
    }
}

#[derive(clap::Args)]
pub struct MakeArgs {
    /// qwen3, qwen3_moe, qwen3_next, qwen3_5 or qwen3_5_moe.
    #[arg(long, default_value = "qwen3")]
    arch: String,
    /// tiny, small, 0.6b, 8b, 32b (qwen3); tiny, small, 30b-a3b (qwen3_moe); tiny, small (hybrids).
    #[arg(long, default_value = "tiny")]
    preset: String,
    #[command(flatten)]
    tensors: TensorArgs,
    /// Tie (true) or untie (false) input and output embeddings, overriding the preset.
    #[arg(long)]
    tie: Option<bool>,
    /// Decoder layers, overriding the preset's.
    #[arg(long)]
    layers: Option<i32>,
    /// Hybrid models: also write a multi-token-prediction head (mtp.*).
    #[arg(long)]
    mtp: bool,
    /// `mlx` (as mlx-community publishes) or `transformers` (as Qwen publishes hybrids).
    #[arg(long, default_value = "mlx")]
    layout: String,
    /// Start a new safetensors shard after this many MiB.
    #[arg(long, default_value_t = 4096)]
    shard_mib: usize,
    #[arg(long)]
    out: PathBuf,
}

pub fn run(cmd: Command) -> Result<()> {
    let a = match cmd {
        Command::MakeCheckpoint(a) => a,
        Command::MakeDrafter { target, layers, block_size, taps, intermediate_size, tensors: tensor_args, out } => {
            let config = engine::ModelConfig::load(&target)?;
            let mut tensors = MakeOptions::new(Architecture::Qwen3, "tiny");
            tensor_args.apply(&mut tensors)?;
            let mut opts = DrafterOptions::new(&config, tensors);
            opts.target_layers = match taps.is_empty() {
                true => spread_taps(config.num_hidden_layers.max(1) as usize, layers.max(1) as usize),
                false => taps,
            };
            (opts.layers, opts.block_size, opts.intermediate_size) = (layers, block_size, intermediate_size);
            let made = make_drafter(&config, &opts, &out)?;
            println!(
                "wrote {}: {} parameters, blocks of {block_size}, reading target layers {:?}",
                made.dir.display(),
                made.parameters,
                opts.target_layers
            );
            return Ok(());
        }
        Command::TrainTokenizer { docs, vocab, out } => return train_tokenizer(&docs, vocab, &out),
        Command::Tokenize { tokenizer, docs, out } => return tokenize(&tokenizer, &docs, &out),
        Command::Ops { model, context, positions, prefill, json } => {
            return ops(&model, &context, &positions, prefill, json)
        }
        Command::Batch { model, rounds, join_prompt: Some(prompt), interleave, .. } => {
            return crate::batch::interleave(&model, prompt, &interleave, rounds.max(1))
        }
        Command::Batch { model, streams, tokens, rounds, join_prompt: None, .. } => {
            return crate::batch::run(&model, &streams, tokens, rounds.max(1))
        }
        Command::Collectives { backend, rounds, die_after, stall_after } => {
            let failure = crate::collectives::Failure { die_after, stall_after };
            return crate::collectives::run(&backend, rounds, failure);
        }
        Command::VisionTower(picture) => return crate::vision::tower_times(&picture),
        Command::VisionPrefill { picture, text, tokens_out } => {
            return crate::vision::prefill_times(&picture, text, tokens_out.as_deref());
        }
        Command::Depth { model, code_ids, code_tokens, prose, depth, rounds, drafter } => {
            let o = crate::depth::Options {
                model: &model,
                drafter: drafter.as_deref(),
                code_ids: &code_ids,
                code_tokens,
                prose: &prose,
                depth,
                rounds: rounds.max(1),
            };
            return crate::depth::run(o);
        }
        Command::Perplexity { model, text, tokens, skip, window, chunk } => {
            return perplexity(&model, &text, tokens, skip, window, chunk)
        }
    };
    let mut opts = MakeOptions::new(Architecture::parse(&a.arch)?, &a.preset);
    a.tensors.apply(&mut opts)?;
    opts.tie_embeddings = a.tie;
    opts.layers = a.layers;
    opts.shard_bytes = a.shard_mib.max(1) << 20;
    opts.mtp = a.mtp;
    opts.layout = match a.layout.as_str() {
        "mlx" => Layout::Mlx,
        "transformers" | "hf" => Layout::Transformers,
        other => bail!("--layout: unknown layout `{other}` (mlx, transformers)"),
    };
    let made = checkpoint::make(&opts, &a.out)?;
    println!(
        "wrote {}: {} parameters, {:.1} MB of weights in {} file(s)",
        made.dir.display(),
        made.parameters,
        made.bytes as f64 / 1e6,
        made.files.len()
    );
    Ok(())
}

fn parse_dtype(name: &str) -> Result<Dtype> {
    Ok(match name {
        "f32" | "float32" => Dtype::Float32,
        "bf16" | "bfloat16" => Dtype::Bfloat16,
        "f16" | "float16" => Dtype::Float16,
        other => bail!("--dtype: unknown type `{other}` (f32, bf16, f16)"),
    })
}

fn perplexity(
    model: &std::path::Path,
    files: &[PathBuf],
    tokens: usize,
    skip: usize,
    window: usize,
    chunk: usize,
) -> Result<()> {
    use anyhow::Context;
    let engine =
        engine::Engine::load_with(model, &server::engine_options::from_env(engine::Profile::default(), None)?)?;
    let mut text = String::new();
    for f in files {
        text += &std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?;
        text.push('\n');
    }
    let mut ids = engine.tokenizer().encode(&text)?;
    ids.drain(..skip.min(ids.len()));
    ids.truncate(tokens);
    println!("{} tokens of {} file(s); perplexity by position (window {window}):", ids.len(), files.len());
    let started = std::time::Instant::now();
    let nll = engine::perplexity::position_nll(engine.model(), &ids, chunk)?;
    for (i, w) in nll.chunks(window.max(1)).enumerate() {
        let mean = w.iter().map(|&x| x as f64).sum::<f64>() / w.len() as f64;
        println!("  positions {:>6}-{:<6} perplexity {:.2}", i * window, i * window + w.len(), mean.exp());
    }
    println!("({:.0} s)", started.elapsed().as_secs_f64());
    Ok(())
}
