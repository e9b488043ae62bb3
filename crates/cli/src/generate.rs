use std::io::Write;

use anyhow::{Context, Result};
use engine::tokenizer::ChatMessage;
use engine::{CancelToken, Engine, Event, GenerateRequest, SamplingParams};

#[derive(clap::Args)]
pub struct Args {
    /// Model: a folder (config.json, *.safetensors, tokenizer.json), a catalog id or alias,
    /// a registered id, or a repository.
    #[arg(long, short)]
    model: String,
    /// The prompt text.
    #[arg(long, short)]
    prompt: String,
    /// Wrap the prompt as a user turn in the model's chat template.
    #[arg(long)]
    chat: bool,
    /// With --chat: ask the template to skip the thinking block.
    #[arg(long, requires = "chat")]
    no_think: bool,
    /// Hold the answer to the JSON Schema in this file while decoding.
    #[arg(long, group = "grammar")]
    json_schema: Option<std::path::PathBuf>,
    /// Hold the answer to this regular expression while decoding.
    #[arg(long, group = "grammar")]
    regex: Option<String>,
    /// Hold the answer to the Lark grammar (llguidance's dialect) in this file while decoding.
    #[arg(long, group = "grammar")]
    lark: Option<std::path::PathBuf>,
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// Sampling temperature; 0 = greedy.
    #[arg(long = "temp", default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// 0 = off.
    #[arg(long, default_value_t = 0)]
    top_k: i32,
    /// 0 = off.
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    #[arg(long)]
    seed: Option<u64>,
    /// Divide repeated tokens' positive logits by this, multiply negative ones (1 = off; as
    /// mlx-lm, over the last 20 tokens).
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    /// Subtract this from the logit of each token among the last 20 (0 = off).
    #[arg(long, default_value_t = 0.0)]
    presence_penalty: f32,
    /// Subtract this from a token's logit for each time it is among the last 20 (0 = off).
    #[arg(long, default_value_t = 0.0)]
    frequency_penalty: f32,
    /// Stop before this string (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Draft this many tokens per cycle with the model's MTP head (0 = plain decoding, max 4),
    /// or `auto`: what `ferrite tune` stored for this machine, model and profile.
    #[arg(long, default_value = "auto")]
    draft_depth: String,
    /// A DFlash block drafter's folder (z-lab's format) to draft with instead of the MTP head;
    /// `--draft-depth` then counts the block's drafts verified (up to its block size - 1).
    #[arg(long, conflicts_with = "hosts")]
    drafter: Option<std::path::PathBuf>,
    /// Runtime profile (`ferrite profiles` lists the knobs).
    #[arg(long, env = "FERRITE_PROFILE", default_value = "sustained")]
    profile: engine::ProfileName,
    /// Split the model across the ranks this host file lists (mlx.launch's format: a JSON list
    /// of `{"ssh": host, "ips": [address]}`; this process is the first).
    #[arg(long)]
    hosts: Option<std::path::PathBuf>,
    /// The collectives' backend with --hosts.
    #[arg(long, value_enum, default_value = "ring", requires = "hosts")]
    backend: crate::ranks::Backend,
}

pub fn run(args: Args) -> Result<()> {
    let mut spec = server::launch::spec(&args.model, &args.draft_depth, args.profile)?;
    if let Some(drafter) = args.drafter.clone() {
        spec = server::launch::with_drafter(spec, drafter, &args.draft_depth);
    }
    if args.hosts.is_some() {
        spec = server::launch::without_drafter(spec, "a model split across ranks drafts with its MTP head only");
    }
    let (dir, speculation) = (spec.dir, spec.depth.speculation);
    let ranks = match &args.hosts {
        Some(file) => {
            let hosts = crate::ranks::read_hosts(file)?;
            let follower = crate::ranks::FollowerArgs { model: &dir, profile: args.profile };
            Some(crate::ranks::Ranks::start(&hosts, args.backend, follower, true)?)
        }
        None => None,
    };
    let group = ranks.as_ref().map(crate::ranks::Ranks::group);
    let mut options = server::engine_options::from_env(engine::Profile::named(args.profile), group)?;
    options.drafter = spec.drafter;
    let engine = Engine::load_with(&dir, &options).with_context(|| format!("loading {}", dir.display()))?;
    answer(&engine, args, speculation)?;
    // What the model holds with its caches emptied (split: each rank its part).
    engine.clear_prompt_cache();
    crate::ranks::report_memory(&engine);
    engine.dismiss_followers()?;
    drop(engine);
    if let Some(ranks) = ranks {
        ranks.finish(std::time::Duration::from_secs(10));
    }
    Ok(())
}

fn answer(engine: &Engine, args: Args, speculation: engine::Speculation) -> Result<()> {
    let text = if args.chat {
        let mut extra = serde_json::Map::new();
        if args.no_think {
            extra.insert("enable_thinking".into(), false.into());
        }
        engine.tokenizer().apply_chat_template(&[ChatMessage::new("user", &args.prompt)], true, &extra)?
    } else {
        args.prompt.clone()
    };
    let read =
        |path: &std::path::Path| std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()));
    let grammar = match (&args.json_schema, &args.regex, &args.lark) {
        (Some(file), _, _) => Some(engine::Grammar::JsonSchema(
            serde_json::from_str(&read(file)?).with_context(|| format!("{}: not JSON", file.display()))?,
        )),
        (_, Some(rx), _) => Some(engine::Grammar::Regex(rx.clone())),
        (_, _, Some(file)) => Some(engine::Grammar::Lark(read(file)?)),
        _ => None,
    };
    let request = GenerateRequest {
        prompt: engine.tokenizer().encode(&text)?,
        max_tokens: args.max_tokens,
        sampling: SamplingParams {
            temperature: args.temperature,
            top_p: args.top_p,
            top_k: args.top_k,
            min_p: args.min_p,
            seed: args.seed,
            penalties: engine::Penalties {
                repetition: args.repetition_penalty,
                presence: args.presence_penalty,
                frequency: args.frequency_penalty,
            },
            logit_bias: Vec::new(),
        },
        stop: args.stop,
        ignore_eos: false,
        draft_depth: speculation.depth,
        draft_with: speculation.drafter,
        fixed_depth: false,
        draft_script: None,
        forced_tokens: None,
        grammar,
        images: Vec::new(),
        prefill_chunk: None,
    };
    let mut out = std::io::stdout().lock();
    for event in engine.generate(request, CancelToken::default())? {
        match event? {
            Event::Text(t) => {
                out.write_all(t.as_bytes())?;
                out.flush()?;
            }
            Event::Finished(s) => {
                let t = &s.timings;
                writeln!(out)?;
                eprintln!(
                    "[{} prompt tokens, TTFT {:.1} ms, prompt {:.1} tok/s | {} tokens, decode {:.1} tok/s | peak memory {:.1} MB | {:?}, {}]",
                    s.usage.prompt_tokens,
                    t.ttft.as_secs_f64() * 1e3,
                    t.prompt_tps,
                    s.usage.completion_tokens,
                    t.decode_tps,
                    t.peak_memory_bytes as f64 / 1e6,
                    s.finish_reason,
                    engine.backend(),
                );
                if let Some(spec) = &s.speculative {
                    let per_position: Vec<String> =
                        spec.acceptance().iter().map(|a| format!("{:.0}%", a * 100.0)).collect();
                    eprintln!(
                        "[{} depth {}: {} cycles, {:.2} tokens/cycle, acceptance by position {} | draft {:.2} ms, verify {:.2} ms per cycle]",
                        if speculation.drafter == engine::DraftWith::Block { "block drafter" } else { "MTP" },
                        spec.depth,
                        spec.cycles,
                        spec.tokens_per_cycle(),
                        per_position.join(" "),
                        spec.draft_time.as_secs_f64() * 1e3 / spec.cycles.max(1) as f64,
                        spec.verify_time.as_secs_f64() * 1e3 / spec.cycles.max(1) as f64,
                    );
                }
            }
        }
    }
    Ok(())
}
