use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use anyhow::Result;

#[derive(clap::Args)]
pub struct Args {
    /// Model folder to load.
    #[arg(long, short)]
    model: PathBuf,
    /// Name clients use for the model (default: the folder name).
    #[arg(long)]
    id: Option<String>,
    /// Another name accepted for the model (repeatable).
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
    /// MTP draft depth for every request (0 = plain decoding, at most 4).
    #[arg(long, default_value_t = 0)]
    draft_depth: usize,
    /// Unload the model after this many minutes without a request (0 = never); the next
    /// request loads it again.
    #[arg(long, default_value_t = 10)]
    idle_minutes: u64,
}

pub fn run(args: Args) -> Result<()> {
    let config = server::ServerConfig {
        model_dir: args.model,
        model_id: args.id,
        aliases: args.alias,
        addr: SocketAddr::new(args.host, args.port),
        api_key: args.api_key,
        draft_depth: args.draft_depth,
        idle_unload: (args.idle_minutes > 0).then(|| std::time::Duration::from_secs(60 * args.idle_minutes)),
    };
    tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(server::serve(config))
}
