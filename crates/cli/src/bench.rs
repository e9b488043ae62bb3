//! `ferrite bench`: decode and prefill speed of one model on fixed prompt ids, as JSON, for
//! bench/ scripts that run mlx-lm on the same checkpoint and ids in the same run.

use std::path::PathBuf;

use anyhow::{Context, Result};
use engine::{DraftWith, Engine, GenerateRequest};

#[derive(clap::Args)]
pub struct Args {
    #[arg(long, short)]
    model: PathBuf,
    /// JSON array of prompt token ids (the same file the peer reads).
    #[arg(long)]
    prompt_ids: PathBuf,
    /// Tokens to generate per run (end-of-sequence is ignored).
    #[arg(long, default_value_t = 128)]
    gen_tokens: usize,
    /// Timed runs after one warm-up; the median is reported.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Measure speculative decoding instead: the cost of a verify pass of D+1 tokens and of a
    /// draft step relative to a plain step, acceptance and decode speed for D = 1..4.
    #[arg(long)]
    spec: bool,
    /// With --spec: sampling temperature (0 = greedy); several prompts (a JSON array of
    /// arrays) are all run and their figures pooled.
    #[arg(long, default_value_t = 0.0)]
    temp: f32,
    /// Runtime profile (`ferrite profiles` lists the knobs).
    #[arg(long, env = "FERRITE_PROFILE", default_value = "sustained")]
    profile: engine::ProfileName,
    /// With --spec: also a DFlash block drafter's folder; its block depths are measured in the
    /// same run as plain decoding and the MTP head's depths.
    #[arg(long, requires = "spec")]
    drafter: Option<PathBuf>,
}

pub fn run(args: Args) -> Result<()> {
    let text =
        std::fs::read_to_string(&args.prompt_ids).with_context(|| format!("reading {}", args.prompt_ids.display()))?;
    // One prompt, or several (`--spec` pools them; plain timing uses the first).
    let prompts: Vec<Vec<u32>> = serde_json::from_str::<Vec<Vec<u32>>>(&text)
        .or_else(|_| serde_json::from_str::<Vec<u32>>(&text).map(|p| vec![p]))
        .with_context(|| {
            format!("{}: expected a JSON array of token ids, or an array of such arrays", args.prompt_ids.display())
        })?;
    anyhow::ensure!(!prompts.is_empty(), "{}: no prompt", args.prompt_ids.display());
    let mut options = server::engine_options::from_env(engine::Profile::named(args.profile), None)?;
    options.drafter = args.drafter.clone();
    let mut engine = Engine::load_with(&args.model, &options)?;
    // Every run after the warm-up repeats its prompt: the prompt cache would answer it, and
    // this measures computing it (bench/agent_session.py measures the cache).
    engine.set_prompt_cache_budget(0);
    let request = GenerateRequest { ignore_eos: true, ..GenerateRequest::greedy(prompts[0].clone(), args.gen_tokens) };
    if args.spec {
        let mut request = request;
        request.sampling.temperature = args.temp;
        request.sampling.seed = Some(0);
        return speculative(&mut engine, &request, &prompts, args.runs);
    }
    let mut decode = Vec::new();
    let mut prefill = Vec::new();
    let mut ttft = Vec::new();
    let mut cpu_start = 0.0;
    for run in 0..=args.runs.max(1) {
        if run == 1 {
            cpu_start = cpu_seconds();
        }
        let (_, summary) = engine.generate_text(request.clone())?;
        anyhow::ensure!(
            summary.usage.completion_tokens == args.gen_tokens,
            "generated {} tokens, wanted {}",
            summary.usage.completion_tokens,
            args.gen_tokens
        );
        if run > 0 {
            decode.push(summary.timings.decode_tps);
            prefill.push(summary.timings.prompt_tps);
            ttft.push(summary.timings.ttft.as_secs_f64());
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    };
    let cpu_per_token =
        (cpu_seconds() - cpu_start) / (args.runs.max(1) * (request.prompt.len() + args.gen_tokens)) as f64;
    let report = serde_json::json!({
        "engine": "ferrite",
        "backend": engine.backend().to_string(),
        "profile": args.profile.to_string(),
        "delta_path": engine::delta_path::current().name(),
        "matmul_path": engine::matmul_path::current().name(),
        "cpu_seconds_per_token": cpu_per_token,
        "prompt_tokens": request.prompt.len(),
        "gen_tokens": args.gen_tokens,
        "decode_tps": median(&mut decode),
        "prompt_tps": median(&mut prefill),
        "ttft_s": median(&mut ttft),
        "peak_memory_bytes": engine::memory::peak_memory_bytes(),
    });
    println!("{report}");
    Ok(())
}

/// User plus system CPU time of this process so far.
fn cpu_seconds() -> f64 {
    // SAFETY: getrusage writes into the struct we pass.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) } != 0 {
        return 0.0;
    }
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    secs(usage.ru_utime) + secs(usage.ru_stime)
}

type Pooled = (f64, Option<engine::speculative::SpecStats>);

/// Every prompt at `depth` drafted by `draft_with` (after one warm-up on the first): pooled
/// statistics, and tokens over decode time.
fn decode_all(
    engine: &Engine,
    request: &GenerateRequest,
    prompts: &[Vec<u32>],
    depth: usize,
    draft_with: DraftWith,
) -> Result<Pooled> {
    let warm = GenerateRequest { draft_depth: depth, draft_with, ..request.clone() };
    engine.generate_text(warm)?;
    let (mut tokens, mut seconds, mut pooled) = (0usize, 0f64, None::<engine::speculative::SpecStats>);
    for prompt in prompts {
        let req = GenerateRequest { draft_depth: depth, draft_with, prompt: prompt.clone(), ..request.clone() };
        let (_, s) = engine.generate_text(req)?;
        let decoded = s.usage.completion_tokens.saturating_sub(1);
        tokens += decoded;
        seconds += if s.timings.decode_tps > 0.0 { decoded as f64 / s.timings.decode_tps } else { 0.0 };
        if let Some(stats) = s.speculative {
            match &mut pooled {
                Some(p) => p.merge(&stats),
                None => pooled = Some(stats),
            }
        }
    }
    Ok((if seconds > 0.0 { tokens as f64 / seconds } else { 0.0 }, pooled))
}

fn speculative(engine: &mut Engine, request: &GenerateRequest, prompts: &[Vec<u32>], runs: usize) -> Result<()> {
    // What the MTP head's steps and the block drafter's passes cost (when there are any).
    let costs = match engine.can_draft() {
        true => {
            let iters = 10 * runs.max(1);
            let costs = engine::costs::measure_costs(engine.model(), engine.drafter(), &request.prompt, iters)?;
            Some((costs, engine::costs::measure_waited_step(engine.model(), &request.prompt, iters)?))
        }
        false => None,
    };
    let decode = |engine: &Engine, depth, draft_with| decode_all(engine, request, prompts, depth, draft_with);
    let (plain_tps, _) = decode(engine, 0, DraftWith::Mtp)?;
    if let Some((costs, waited)) = &costs {
        let head = match (costs.draft_step_s, costs.draft_ratio()) {
            (Some(s), Some(r)) => format!(", MTP draft step {:.3} ms ({r:.2}x)", s * 1e3),
            _ => String::new(),
        };
        let block =
            match (costs.block_draft_s.last(), costs.drafting_ratio(DraftWith::Block, costs.block_draft_s.len())) {
                (Some(s), Some(r)) => format!(", block pass {:.3} ms ({r:.2}x)", s * 1e3),
                _ => String::new(),
            };
        eprintln!(
            "plain decode {plain_tps:.1} tok/s; plain step {:.3} ms (waited for {:.3} ms, graph {:.3} ms){head}{block}",
            costs.plain_step_s * 1e3,
            waited.waited_s * 1e3,
            waited.build_s * 1e3
        );
    }
    let costs = costs.map(|(costs, _)| costs);
    eprintln!(
        "{:>5} {:>5} {:>12} {:>10} {:>22} {:>10} {:>10} {:>16} {:>14}",
        "draft",
        "depth",
        "verify cost",
        "graph ms",
        "acceptance by position",
        "tok/cycle",
        "tok/s",
        "bound (measured)",
        "bound (all ok)"
    );
    let mut rows = Vec::new();
    // The MTP head's depths (when the model has one), then the block drafter's (when loaded).
    let mtp_depths = if engine.model().mtp().is_some() { engine::costs::MAX_DRAFT_DEPTH } else { 0 };
    let block_depths = engine.drafter().map_or(0, |d| d.max_drafts());
    let runs = (1..=mtp_depths).map(|d| (d, DraftWith::Mtp)).chain((1..=block_depths).map(|d| (d, DraftWith::Block)));
    let shown = |x: Option<f64>| x.map_or("-".to_string(), |x| format!("{x:.2}"));
    for (depth, draft_with) in runs {
        let drafter = if draft_with == DraftWith::Mtp { "mtp" } else { "block" };
        let (tps, stats) = decode(engine, depth, draft_with)?;
        let stats = stats.unwrap_or_default();
        let acceptance = stats.acceptance();
        let acc_text: Vec<String> = acceptance.iter().map(|a| format!("{:.0}%", a * 100.0)).collect();
        let verify = costs.as_ref().filter(|c| depth <= c.verify_s.len()).map(|c| c.verify_ratio(depth));
        // Of the verify pass, the host's graph building (milliseconds).
        let graph = costs.as_ref().and_then(|c| c.verify_build_s.get(depth - 1)).map(|s| s * 1e3);
        let bound = costs.as_ref().and_then(|c| c.speedup_bound(draft_with, depth, &acceptance));
        let best = costs.as_ref().and_then(|c| c.speedup_bound(draft_with, depth, &vec![1.0; depth]));
        eprintln!(
            "{drafter:>5} {depth:>5} {:>12} {:>10} {:>22} {:>10.2} {tps:>10.1} {:>16} {:>14}",
            shown(verify),
            shown(graph),
            acc_text.join(" "),
            stats.tokens_per_cycle(),
            shown(bound),
            shown(best),
        );
        rows.push(serde_json::json!({
            "drafter": drafter, "depth": depth, "verify_cost": verify, "verify_graph_s": graph.map(|ms| ms / 1e3),
            "acceptance": acceptance,
            "tokens_per_cycle": stats.tokens_per_cycle(), "decode_tps": tps,
            "speedup_bound": bound, "speedup_bound_full_acceptance": best,
        }));
    }
    // The runtime controller with the costs measured above, from MTP depth 2 and from block
    // depth 3: where the model has both drafters the other stands by and may take over.
    // Its prompts follow one another as an agent's requests do (each starts where the last one
    // ended); each start begins afresh.
    if let Some(c) = &costs {
        let starts = [(2, DraftWith::Mtp, mtp_depths > 0), (3, DraftWith::Block, block_depths >= 3)];
        for (depth, draft_with, _) in starts.into_iter().filter(|s| s.2) {
            engine.set_depth_costs(Some(engine::depth_control::CostModel::from(c)));
            let (tps, stats) = decode(engine, depth, draft_with)?;
            let stats = stats.unwrap_or_default();
            let control = stats.control.clone().unwrap_or_default();
            // The cycles after plain steps catch a drafter up: what each took, against a cycle's
            // mean (both in plain steps of the cost model).
            let in_steps = |s: f64, n: usize| if n > 0 { s / n as f64 / c.plain_step_s } else { 0.0 };
            let crossings = &control.after_plain;
            let after_plain = in_steps(crossings.time.as_secs_f64(), crossings.cycles);
            let catch_up = in_steps(crossings.catch_up_time.as_secs_f64(), crossings.cycles);
            let cycle = in_steps((stats.draft_time + stats.verify_time).as_secs_f64(), stats.cycles);
            eprintln!(
                "controller from {} depth {depth}: {tps:.1} tok/s, {:.2} tokens a cycle; at the end {} depth {}, \
                 {} drafter switch(es), {:?}; {} cycles after plain steps at {after_plain:.2} plain steps each, \
                 {catch_up:.2} of it catching up (a cycle or plain step: {cycle:.2})",
                draft_with.name(),
                stats.tokens_per_cycle(),
                control.drafter_now.name(),
                control.depth_now,
                control.switches,
                control.changes,
                crossings.cycles,
            );
            rows.push(serde_json::json!({
                "drafter": draft_with.name(), "depth": depth, "controller": true, "acceptance": stats.acceptance(),
                "tokens_per_cycle": stats.tokens_per_cycle(), "decode_tps": tps, "control": control,
                "after_plain_cost": after_plain, "catch_up_cost": catch_up, "mean_cycle_cost": cycle,
            }));
        }
    }
    println!(
        "{}",
        serde_json::json!({
            "engine": "ferrite", "backend": engine.backend().to_string(), "temperature": request.sampling.temperature,
            "matmul_path": engine::matmul_path::current().name(),
            "prompts": prompts.len(), "gen_tokens": request.max_tokens, "plain_decode_tps": plain_tps,
            "plain_step_s": costs.as_ref().map(|c| c.plain_step_s),
            "draft_step_s": costs.as_ref().and_then(|c| c.draft_step_s),
            "draft_cost": costs.as_ref().and_then(|c| c.draft_ratio()),
            "block_pass_s": costs.as_ref().map(|c| c.block_draft_s.clone()),
            "drafter": engine.drafter().map(|d| d.dir.display().to_string()),
            "depths": rows,
        })
    );
    Ok(())
}
