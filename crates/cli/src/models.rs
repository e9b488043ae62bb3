//! `ferrite pull | ls | rm | store …`: the model store from the command line, through the
//! same config file and models folder the app uses.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use store::download::{Downloader, Kind, Options, Request, State};
use store::Store;

#[derive(clap::Subcommand)]
pub enum StoreCommand {
    /// Where models are stored, and where that choice is kept.
    Show,
    /// Store models in DIR from now on (hub-cache layout; the app uses the same setting).
    Set { dir: PathBuf },
    /// Use an MLX model folder where it is, under the name ID.
    Add { id: String, dir: PathBuf },
}

/// Bytes for people: MiB below a GiB, GiB above.
fn gib(bytes: u64) -> String {
    if bytes < 1 << 30 {
        format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
    } else {
        format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
    }
}

/// `ferrite pull NAME`: the model, and the block drafter the catalog pairs with it.
pub fn pull(name: &str) -> Result<()> {
    let store = Store::open_default()?;
    let entry = store.catalog.find(name);
    let mut requests = match entry {
        Some(e) if e.embedded.is_some() => {
            println!("{}: ships with Ferrite ({}), nothing to download", e.id, store.resolve(&e.id)?.dir.display());
            vec![]
        }
        Some(e) => vec![Request::model(e.repo.clone(), e.revision.clone(), e.mtp)],
        None if name.split('/').count() == 2 => vec![Request::model(name.to_string(), "main".to_string(), false)],
        None => bail!("`{name}` is neither a catalog model (see `ferrite ls`) nor a repository (org/name)"),
    };
    requests.extend(entry.and_then(Request::drafter_of));
    if requests.is_empty() {
        return Ok(());
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async {
        let downloader = Downloader::new(store.models_dir.clone(), Options::default());
        for request in requests {
            let (repo, kind) = (request.repo.clone(), request.kind);
            let dir = pull_one(&downloader, request).await?;
            let what = if kind == Kind::Drafter { "block drafter installed" } else { "installed" };
            println!("{repo}: {what} in {}", dir.display());
        }
        anyhow::Ok(())
    })
}

/// One download with a progress bar; Ctrl-C cancels it (a new pull resumes).
async fn pull_one(downloader: &Downloader, request: Request) -> Result<PathBuf> {
    let download = downloader.pull(request);
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{msg:30!} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} ETA {eta}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    let mut progress = download.progress();
    let stop = tokio::signal::ctrl_c();
    tokio::pin!(stop);
    loop {
        {
            let p = progress.borrow_and_update();
            bar.set_length(p.total_bytes);
            bar.set_position(p.done_bytes);
            bar.set_message(match &p.state {
                State::Verifying => "verifying".to_string(),
                _ => p.file.clone(),
            });
            if p.state.is_final() {
                break;
            }
        }
        tokio::select! {
            changed = progress.changed() => if changed.is_err() { break },
            _ = &mut stop => {
                download.cancel();
                bar.abandon_with_message("cancelled: a new pull resumes");
            }
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
    }
    bar.finish_and_clear();
    Ok(download.wait().await?)
}

pub fn ls() -> Result<()> {
    let store = Store::open_default()?;
    let listing = store.list();
    println!("models folder: {}", store.models_dir.display());
    println!("\ninstalled:");
    if listing.installed.is_empty() {
        println!("  (none)");
    }
    for m in &listing.installed {
        println!(
            "  {:<28} {:>10}  {:<12} mtp:{:<3}  sees:{:<3}  {}",
            m.id,
            gib(m.bytes),
            m.model_type,
            if m.has_mtp { "yes" } else { "no" },
            if m.sees { "yes" } else { "no" },
            m.dir.display()
        );
    }
    if !listing.drafters.is_empty() {
        println!("\nblock drafters (loaded beside a model):");
    }
    for d in &listing.drafters {
        let drafts_for = if d.drafts_for.is_empty() { "no catalog model".to_string() } else { d.drafts_for.join(", ") };
        println!(
            "  {:<28} {:>10}  block {:<6} for {drafts_for}  {}",
            d.repo,
            gib(d.bytes),
            d.block_size,
            d.dir.display()
        );
    }
    if !listing.incomplete.is_empty() {
        println!("\nnot usable (unfinished or damaged; `ferrite pull` resumes):");
        for m in &listing.incomplete {
            println!("  {:<28} {}", m.repo, m.reason);
        }
    }
    println!("\navailable (models.toml):");
    for e in &store.catalog.entries {
        let size = e.size_bytes.value().map(|b| gib(*b)).unwrap_or_else(|| "size unknown".into());
        let aliases =
            if e.aliases.is_empty() { String::new() } else { format!(" (aliases: {})", e.aliases.join(", ")) };
        println!(
            "  {:<28} {:>12}  {:<12} mtp:{:<3}  sees:{:<7}  {}{aliases}",
            e.id,
            size,
            e.architecture,
            if e.mtp { "yes" } else { "no" },
            match e.sees.value() {
                Some(true) => "yes",
                Some(false) => "no",
                None => "unknown",
            },
            if e.repo.is_empty() { "(ships with Ferrite)" } else { e.repo.as_str() }
        );
        if let Some(d) = &e.drafter {
            let source = if d.embedded.is_some() { "(ships with Ferrite)" } else { d.repo.as_str() };
            println!("  {:<28} {:>12}  block drafter, block {}: {source}", "", "", d.block_size);
        }
    }
    Ok(())
}

pub fn rm(name: &str) -> Result<()> {
    let mut store = Store::open_default()?;
    let freed = store.delete(name)?;
    println!("removed {name}: {} freed", gib(freed));
    Ok(())
}

pub fn store_command(cmd: StoreCommand) -> Result<()> {
    let mut store = Store::open_default()?;
    match cmd {
        StoreCommand::Show => {
            println!("models folder: {}", store.models_dir.display());
            println!("config file:   {}", store::Config::path(&store.config_dir).display());
            println!("user catalog:  {}", store::catalog::user_file(&store.config_dir).display());
            match store::download::free_space(&store.models_dir) {
                Ok(free) => println!("free space:    {}", gib(free)),
                Err(e) => println!("free space:    unknown ({e})"),
            }
        }
        StoreCommand::Set { dir } => {
            store.set_models_dir(&dir).with_context(|| format!("choosing {}", dir.display()))?;
            println!("models folder: {}", store.models_dir.display());
        }
        StoreCommand::Add { id, dir } => {
            let facts = store.register_local(&id, &dir)?;
            println!(
                "{id}: {} ({}, {} tensors, MTP head: {}) used in place",
                dir.display(),
                facts.model_type,
                facts.tensors,
                facts.has_mtp
            );
        }
    }
    Ok(())
}
