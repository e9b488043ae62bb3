//! `ferrite cache show|clear`: the prompt cache's disk tier (where its blocks are, how much
//! they take of its budget; removing them all).

use anyhow::Result;
use engine::prompt_cache::disk;

#[derive(clap::Subcommand)]
pub enum CacheCommand {
    /// The folder, its budget, and the blocks of each model in it.
    Show,
    /// Remove every block (servers using the folder keep what they hold in memory).
    Clear,
}

pub fn run(cmd: CacheCommand) -> Result<()> {
    let Some(engine::prompt_cache::DiskSettings { dir, budget, .. }) = server::launch::prompt_disk() else {
        println!(
            "the prompt cache's disk tier is off (config.toml [prompt_cache] disk_gb = 0, or FERRITE_PROMPT_DISK_GB=0)"
        );
        return Ok(());
    };
    match cmd {
        CacheCommand::Show => {
            let (blocks, bytes) = disk::usage(&dir);
            println!("folder: {}", dir.display());
            println!("budget: {:.2} GB (config.toml [prompt_cache] disk_gb)", budget as f64 / 1e9);
            println!("blocks: {blocks}, {:.2} GB", bytes as f64 / 1e9);
            for model in std::fs::read_dir(&dir).into_iter().flatten().flatten().filter(|m| m.path().is_dir()) {
                let (blocks, bytes) = disk::usage_of_model(&model.path());
                println!(
                    "  model {}: {blocks} blocks, {:.1} MB",
                    model.file_name().to_string_lossy(),
                    bytes as f64 / 1e6
                );
            }
        }
        CacheCommand::Clear => {
            let freed = if dir.exists() { disk::clear(&dir)? } else { 0 };
            println!("removed the prompt cache's blocks in {}: {:.2} GB freed", dir.display(), freed as f64 / 1e9);
        }
    }
    Ok(())
}
