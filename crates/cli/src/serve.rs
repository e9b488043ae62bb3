use std::net::{IpAddr, SocketAddr};

use anyhow::Result;

#[derive(clap::Args)]
pub struct Args {
    /// Model to load: a folder, a catalog id or alias, a registered id, or a repository.
    #[arg(long, short)]
    model: String,
    /// Name clients use for the model (default: its catalog id, else the folder name).
    #[arg(long)]
    id: Option<String>,
    /// Another name accepted for the model (repeatable; the catalog's aliases always are).
    #[arg(long)]
    alias: Vec<String>,
    /// Address to bind; anything but loopback needs --api-key.
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Key clients must send (Authorization: Bearer KEY or x-api-key: KEY).
    #[arg(long, env = "FERRITE_API_KEY")]
    api_key: Option<String>,
    /// MTP draft depth for every request: 0 (plain decoding) to 4, or `auto` for what
    /// `ferrite tune` stored for this machine, model and profile (plain decoding if nothing).
    #[arg(long, default_value = "auto")]
    draft_depth: String,
    /// A DFlash block drafter's folder (z-lab's format) to draft with instead of the MTP head;
    /// `--draft-depth` then counts the block's drafts verified (up to its block size - 1).
    #[arg(long)]
    drafter: Option<std::path::PathBuf>,
    /// Unload the model after this many minutes without a request (0 = never); the next
    /// request loads it again.
    #[arg(long, default_value_t = 10)]
    idle_minutes: u64,
    /// What the idle watchdog does: `unload` the model (reloaded on the next request) or
    /// `stop` the server.
    #[arg(long, default_value = "unload")]
    idle_action: server::worker::IdleAction,
    /// Runtime profile: `sustained` (default) or `turbo`; `ferrite profiles` lists the knobs.
    #[arg(long, env = "FERRITE_PROFILE", default_value = "sustained")]
    profile: engine::ProfileName,
    /// Another browser origin allowed to call the API (repeatable; the app's own are always allowed).
    #[arg(long)]
    cors_origin: Vec<String>,
    /// Another name clients may reach the server by, in the Host header (repeatable; loopback
    /// names and the bound address always work). Other names are refused: DNS rebinding.
    #[arg(long)]
    allow_host: Vec<String>,
    /// Answer only requests that name the loaded model (or an alias): others get a 404. By
    /// default the loaded model answers any name (agents send their own defaults).
    #[arg(long)]
    strict_model_names: bool,
    /// At most this many tokens per answer, whatever a request asks (default: what the
    /// context leaves after the prompt). Responses say when they were capped.
    #[arg(long)]
    max_output_tokens: Option<usize>,
    /// The most memory the model and its caches may take, in GB (default: the machine's
    /// memory). A request whose KV cache would not fit what is left is refused, or its answer
    /// shortened (said in a header).
    #[arg(long)]
    max_memory_gb: Option<f64>,
    /// Keep each request's draft depth as asked: no runtime controller (by default the depth
    /// follows the request's live acceptance, from the tuned depth + 1 down to plain decoding).
    #[arg(long)]
    fixed_depth: bool,
    /// Split the model across the ranks this host file lists (mlx.launch's format: a JSON list
    /// of `{"ssh": host, "ips": [address]}`; this process is the first and serves HTTP).
    /// Requests then run one at a time, at their draft depth as asked.
    #[arg(long)]
    hosts: Option<std::path::PathBuf>,
    /// The collectives' backend with --hosts.
    #[arg(long, value_enum, default_value = "ring", requires = "hosts")]
    backend: crate::ranks::Backend,
    /// Tests only: answer prompts that match a rule of this JSON file with the rule's reply,
    /// enforced token by token on the model's logits (crates/server/src/scripted.rs).
    #[arg(long, hide = true)]
    scripted_replies: Option<std::path::PathBuf>,
}

pub fn run(args: Args) -> Result<()> {
    let scripted = match &args.scripted_replies {
        Some(path) => Some(std::sync::Arc::new(server::scripted::ScriptedReplies::load(path)?)),
        None => None,
    };
    let mut model = server::launch::spec(&args.model, &args.draft_depth, args.profile)?;
    if let Some(drafter) = args.drafter.clone() {
        model = server::launch::with_drafter(model, drafter, &args.draft_depth);
    }
    if args.hosts.is_some() {
        model = server::launch::without_drafter(model, "a model split across ranks drafts with its MTP head only");
    }
    let ranks = match &args.hosts {
        Some(file) => {
            let hosts = crate::ranks::read_hosts(file)?;
            let follower = crate::ranks::FollowerArgs { model: &model.dir, profile: args.profile };
            let ranks = crate::ranks::Ranks::start(&hosts, args.backend, follower, false)?;
            let split = ranks.split(&hosts, args.backend);
            Some((ranks, split))
        }
        None => None,
    };
    let split = ranks.as_ref().map(|(_, split)| split.clone());
    let config = server::ServerConfig {
        model_dir: model.dir,
        model_id: Some(args.id.unwrap_or(model.id)),
        aliases: model.aliases.into_iter().chain(args.alias).collect(),
        addr: SocketAddr::new(args.host, args.port),
        api_key: args.api_key,
        depth: model.depth,
        worker: server::worker::WorkerOptions {
            idle: (args.idle_minutes > 0).then(|| std::time::Duration::from_secs(60 * args.idle_minutes)),
            on_idle: args.idle_action,
            profile: engine::Profile::named(args.profile),
            max_output_tokens: args.max_output_tokens.filter(|&n| n > 0),
            memory_budget: args.max_memory_gb.filter(|gb| *gb > 0.0).map(|gb| (gb * 1e9) as u64),
            // Split, each machine's disk would hold its own blocks, and each rank's timings
            // would steer the depth its own way.
            prompt_disk: if split.is_some() { None } else { server::launch::prompt_disk() },
            fixed_depth: args.fixed_depth || split.is_some(),
            split,
            scripted,
            batch_rule: model.batch_rule,
            drafter: model.drafter,
            ..Default::default()
        },
        cors_origins: server::APP_ORIGINS.iter().map(|o| o.to_string()).chain(args.cors_origin).collect(),
        allowed_hosts: args.allow_host,
        resolver: Some(server::launch::resolver()),
        strict_model_names: args.strict_model_names,
    };
    let served = tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(server::serve(config));
    if let Some((ranks, _)) = ranks {
        ranks.finish(std::time::Duration::from_secs(10));
    }
    served
}
