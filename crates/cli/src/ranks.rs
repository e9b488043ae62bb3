//! `--hosts HOSTS.json`: one model split across several processes, one rank each, through
//! MLX's distributed layer (tensor parallelism: the engine's `layers::parallel`).
//!
//! HOSTS.json is `mlx.launch`'s host file: one entry per rank, `{"ssh": "host", "ips":
//! ["10.0.0.2"]}`. This process is rank 0 (the first entry is this machine) and starts the
//! others as `ferrite follow`: on a loopback host (`127.0.0.1`, `localhost`, or no `ssh`) as a
//! local process, elsewhere over ssh the way `mlx.launch` does (the same `ferrite` path and
//! model path on every machine). With the ring backend each rank listens on its first IP, on a
//! free port for loopback hosts and from `FERRITE_RING_PORT` (default 32323) up elsewhere;
//! with NCCL rank 0's first IP is the rendezvous and each local rank gets its own GPU; with
//! JACCL (RDMA over Thunderbolt 5) rank 0's first IP coordinates and each host's `"rdma"`
//! list names the device that reaches each other rank, as `mlx.distributed_config` writes it.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use engine::distributed::Group;
use serde::Deserialize;

/// One entry of the host file.
#[derive(Debug, Clone, Deserialize)]
pub struct Host {
    /// Where to ssh to start this rank (absent: this machine).
    #[serde(default)]
    pub ssh: Option<String>,
    /// The addresses this rank communicates on (the ring backend uses the first).
    #[serde(default)]
    pub ips: Vec<String>,
    /// JACCL (RDMA over Thunderbolt 5): the RDMA device that reaches each rank, `null` for
    /// this rank itself.
    #[serde(default)]
    pub rdma: Vec<Option<String>>,
}

impl Host {
    /// Whether this rank runs on this machine.
    pub fn is_local(&self) -> bool {
        let loopback =
            |name: &str| name == "localhost" || name.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback());
        self.ssh.as_deref().is_none_or(loopback) && self.ips.iter().all(|ip| loopback(ip))
    }
}

/// Reads and checks a host file.
pub fn read_hosts(path: &Path) -> Result<Vec<Host>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let hosts: Vec<Host> = serde_json::from_str(&text).with_context(|| {
        format!(
            "{}: not a host file (a JSON list of {{\"ssh\": host, \"ips\": [address]}}, one per rank)",
            path.display()
        )
    })?;
    if hosts.len() < 2 {
        bail!("{}: a split model needs at least 2 ranks, the file lists {}", path.display(), hosts.len());
    }
    if let Some(i) = hosts.iter().position(|h| h.ips.is_empty()) {
        bail!("{}: rank {i} has no \"ips\" (the address it communicates on)", path.display());
    }
    Ok(hosts)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Backend {
    /// TCP between neighbours (Ethernet, Thunderbolt bridges, loopback).
    Ring,
    /// NVIDIA's collectives (CUDA machines).
    Nccl,
    /// RDMA over Thunderbolt 5 between Macs (the host file names each link's device).
    Jaccl,
}

impl Backend {
    fn name(self) -> &'static str {
        match self {
            Backend::Ring => "ring",
            Backend::Nccl => "nccl",
            Backend::Jaccl => "jaccl",
        }
    }
}

/// What rank 0 needs to start the others: the model and profile they load.
pub struct FollowerArgs<'a> {
    pub model: &'a Path,
    pub profile: engine::ProfileName,
}

/// The group this process leads, and the ranks it started.
pub struct Ranks {
    group: Arc<Group>,
    /// Shared with the thread that watches them ([`watch`]).
    followers: Arc<Mutex<Vec<Follower>>>,
    /// Set once rank 0 is done with the group: the ranks ending then is no loss.
    finishing: Arc<AtomicBool>,
    /// The ring's address file, removed with this.
    _dir: tempfile::TempDir,
}

/// A rank this process started.
pub struct Follower {
    pub rank: usize,
    child: Child,
}

impl Ranks {
    /// Starts ranks 1.. of `hosts` as followers and joins the group as rank 0. A rank that ends
    /// while the group is in use marks the group broken; with `exit_when_lost`, this process
    /// also exits with an error if it is still running [`LOST_GRACE`] later (a collective that
    /// never returns: MLX's ring backend can leave one waiting on a dead peer).
    pub fn start(hosts: &[Host], backend: Backend, follower: FollowerArgs, exit_when_lost: bool) -> Result<Ranks> {
        let dir = tempfile::tempdir()?;
        let (env, files) = environment(hosts, backend)?;
        // Files the environment names: written here for local ranks, by the script for remote ones.
        let mut local_env = env.clone();
        for (name, content) in &files {
            let path = dir.path().join(format!("{name}.json"));
            std::fs::write(&path, content)?;
            local_env.push((name.clone(), path.display().to_string()));
        }
        let exe = std::env::current_exe().context("finding this program to start the other ranks")?;
        let mut followers = Vec::new();
        for (rank, host) in hosts.iter().enumerate().skip(1) {
            let mut rank_env = if host.is_local() { local_env.clone() } else { env.clone() };
            rank_env.push(("MLX_RANK".into(), rank.to_string()));
            if backend == Backend::Nccl {
                rank_env.push(("CUDA_VISIBLE_DEVICES".into(), local_gpu(hosts, rank).to_string()));
            }
            let args = follow_args(backend, &follower);
            let child = if host.is_local() {
                let mut command = Command::new(&exe);
                command.args(&args).envs(rank_env.iter().map(|(k, v)| (k, v)));
                command.stdin(Stdio::null()).stdout(Stdio::null()).spawn()
            } else {
                let ssh = host.ssh.clone().unwrap_or_else(|| host.ips[0].clone());
                let script = remote_script(&rank_env, &files, &exe, &args);
                // BatchMode: a host that wants a password fails at once instead of waiting for one.
                let mut command = Command::new("ssh");
                command.args(["-o", "BatchMode=yes"]).arg(&ssh).arg(script);
                command.stdin(Stdio::null()).stdout(Stdio::null()).spawn()
            };
            let child = match child {
                Ok(child) => child,
                Err(e) => {
                    stop_all(&mut followers);
                    return Err(e).with_context(|| format!("starting rank {rank}"));
                }
            };
            let name = host.ssh.clone().unwrap_or_else(|| host.ips[0].clone());
            tracing::info!("rank {rank} started on {name} (pid {})", child.id());
            eprintln!("[rank {rank} started on {name}, pid {}]", child.id());
            followers.push(Follower { rank, child });
        }
        // This process is rank 0: MLX reads the group from the environment.
        for (key, value) in local_env.iter().chain([("MLX_RANK".to_string(), "0".to_string())].iter()) {
            std::env::set_var(key, value);
        }
        if backend == Backend::Nccl {
            std::env::set_var("CUDA_VISIBLE_DEVICES", local_gpu(hosts, 0).to_string());
        }
        let group = join(backend, &mut followers);
        if group.is_err() {
            stop_all(&mut followers);
        }
        let ranks = Ranks {
            group: Arc::new(group?),
            followers: Arc::new(Mutex::new(followers)),
            finishing: Default::default(),
            _dir: dir,
        };
        watch(ranks.group.clone(), ranks.followers.clone(), ranks.finishing.clone(), exit_when_lost);
        Ok(ranks)
    }

    pub fn group(&self) -> Arc<Group> {
        self.group.clone()
    }

    /// What the server shows of the group: each rank's host, and the backend.
    pub fn split(&self, hosts: &[Host], backend: Backend) -> server::worker::Split {
        server::worker::Split {
            group: self.group.clone(),
            hosts: hosts.iter().map(|h| h.ssh.clone().unwrap_or_else(|| h.ips[0].clone())).collect(),
            backend: backend.name().into(),
        }
    }

    /// Waits up to `limit` for the started ranks to end (they do once dismissed), then stops
    /// those still running.
    pub fn finish(self, limit: Duration) {
        self.finishing.store(true, Ordering::SeqCst);
        let started = Instant::now();
        let mut followers = self.followers.lock().unwrap_or_else(|e| e.into_inner());
        for f in followers.iter_mut() {
            while f.child.try_wait().ok().flatten().is_none() && started.elapsed() < limit {
                std::thread::sleep(Duration::from_millis(20));
            }
            if f.child.try_wait().ok().flatten().is_none() {
                tracing::warn!("rank {} did not end: stopping it", f.rank);
                let _ = f.child.kill();
                let _ = f.child.wait();
            }
        }
    }
}

impl Drop for Ranks {
    fn drop(&mut self) {
        self.finishing.store(true, Ordering::SeqCst);
        stop_all(&mut self.followers.lock().unwrap_or_else(|e| e.into_inner()));
    }
}

/// How long rank 0 may go on after a rank it started ended, before [`watch`] ends it.
pub const LOST_GRACE: Duration = Duration::from_secs(10);

/// Watches the ranks this process started while the group is in use: one that ends marks the
/// group broken (the server's status and requests say so at once), and with `exit_when_lost`
/// a rank 0 still running [`LOST_GRACE`] later (its collective never returned) exits with an
/// error naming the lost rank instead of hanging.
fn watch(group: Arc<Group>, followers: Arc<Mutex<Vec<Follower>>>, finishing: Arc<AtomicBool>, exit_when_lost: bool) {
    std::thread::spawn(move || loop {
        std::thread::sleep(Duration::from_millis(200));
        if finishing.load(Ordering::SeqCst) {
            return;
        }
        let lost = {
            let mut followers = followers.lock().unwrap_or_else(|e| e.into_inner());
            // A rank dismissed by rank 0 ends with success: that is no loss.
            followers
                .iter_mut()
                .find_map(|f| Some((f.rank, f.child.try_wait().ok().flatten().filter(|s| !s.success())?)))
        };
        let Some((rank, status)) = lost else { continue };
        let why = format!("rank {rank} ended ({status}): connection to a peer was lost");
        group.mark_broken(&why);
        tracing::warn!("{why}");
        if !exit_when_lost {
            return;
        }
        let since = Instant::now();
        while since.elapsed() < LOST_GRACE {
            if finishing.load(Ordering::SeqCst) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        eprintln!("error: the model's distributed group is down: {why} (rank 0's collective did not return)");
        std::process::exit(1);
    });
}

fn stop_all(followers: &mut [Follower]) {
    for f in followers {
        if f.child.try_wait().ok().flatten().is_none() {
            let _ = f.child.kill();
            let _ = f.child.wait();
        }
    }
}

/// How long rank 0 waits for the others to join (a remote machine starting its process).
const JOIN_LIMIT: Duration = Duration::from_secs(120);

/// Joins the group as rank 0. MLX's join waits for the other ranks' connections without end,
/// so it runs aside while this watches the ranks it started: one that ends first (a failed
/// ssh, a missing model), or none joining within [`JOIN_LIMIT`], is an error naming it
/// instead of a hang.
fn join(backend: Backend, followers: &mut [Follower]) -> Result<Group> {
    let (joined, result) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = joined.send(Group::init(Some(backend.name()), true));
    });
    let started = Instant::now();
    loop {
        match result.recv_timeout(Duration::from_millis(100)) {
            Ok(group) => return group.context("joining the distributed group as rank 0"),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => bail!("joining the distributed group failed"),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
        }
        for f in followers.iter_mut() {
            if let Some(status) = f.child.try_wait()? {
                bail!("rank {} ended before joining the group ({status}): see its messages above", f.rank);
            }
        }
        if started.elapsed() > JOIN_LIMIT {
            bail!("the other ranks did not join the group within {} s", JOIN_LIMIT.as_secs());
        }
    }
}

/// The ring backend's address file: one list of `ip:port` per rank.
fn ring_addresses(hosts: &[Host]) -> Result<Vec<Vec<String>>> {
    let local = hosts.iter().all(Host::is_local);
    let ports = if local {
        free_ports(hosts.len())?
    } else {
        (0..hosts.len() as u16).map(|i| base_port().map(|p| p + i)).collect::<Result<_>>()?
    };
    Ok(hosts.iter().zip(ports).map(|(h, port)| vec![format!("{}:{port}", h.ips[0])]).collect())
}

fn base_port() -> Result<u16> {
    match std::env::var("FERRITE_RING_PORT") {
        Ok(text) => text.parse().with_context(|| format!("FERRITE_RING_PORT `{text}` is not a port")),
        Err(_) => Ok(32323),
    }
}

/// `n` distinct free ports on loopback (all held until all are chosen).
fn free_ports(n: usize) -> Result<Vec<u16>> {
    let listeners: Vec<_> =
        (0..n).map(|_| std::net::TcpListener::bind("127.0.0.1:0")).collect::<std::io::Result<_>>()?;
    Ok(listeners.iter().map(|l| l.local_addr().map(|a| a.port())).collect::<std::io::Result<_>>()?)
}

/// Which GPU of its machine `rank` takes: its index among the ranks on the same host.
fn local_gpu(hosts: &[Host], rank: usize) -> usize {
    let key = |h: &Host| h.ssh.clone().unwrap_or_else(|| h.ips[0].clone());
    hosts[..rank].iter().filter(|h| key(h) == key(&hosts[rank])).count()
}

fn follow_args(backend: Backend, follower: &FollowerArgs) -> Vec<String> {
    vec![
        "follow".into(),
        "--model".into(),
        follower.model.display().to_string(),
        "--profile".into(),
        follower.profile.to_string(),
        "--backend".into(),
        backend.name().into(),
    ]
}

/// The environment every rank gets for `backend` (rank and GPU apart), and the files it
/// names by variable: (variable, content), e.g. the ring's address file.
type Environment = (Vec<(String, String)>, Vec<(String, String)>);

fn environment(hosts: &[Host], backend: Backend) -> Result<Environment> {
    let local = hosts.iter().all(Host::is_local);
    let port = || -> Result<u16> {
        if local {
            Ok(free_ports(1)?[0])
        } else {
            base_port()
        }
    };
    Ok(match backend {
        Backend::Ring => (vec![], vec![("MLX_HOSTFILE".into(), serde_json::to_string(&ring_addresses(hosts)?)?)]),
        Backend::Nccl => (
            vec![
                ("NCCL_HOST_IP".into(), hosts[0].ips[0].clone()),
                ("NCCL_PORT".into(), port()?.to_string()),
                ("MLX_WORLD_SIZE".into(), hosts.len().to_string()),
            ],
            vec![],
        ),
        Backend::Jaccl => {
            check_rdma(hosts)?;
            let devices: Vec<&Vec<Option<String>>> = hosts.iter().map(|h| &h.rdma).collect();
            (
                vec![("MLX_JACCL_COORDINATOR".into(), format!("{}:{}", hosts[0].ips[0], port()?))],
                vec![("MLX_IBV_DEVICES".into(), serde_json::to_string(&devices)?)],
            )
        }
    })
}

/// JACCL needs every rank's RDMA device to every other rank (`null` to itself), as
/// `mlx.distributed_config` writes them.
fn check_rdma(hosts: &[Host]) -> Result<()> {
    for (i, h) in hosts.iter().enumerate() {
        if h.rdma.len() != hosts.len()
            || h.rdma[i].is_some()
            || h.rdma.iter().enumerate().any(|(j, d)| j != i && d.is_none())
        {
            bail!(
                "the jaccl backend needs each host's \"rdma\": one device per rank, null for itself \
                 (rank {i} has {:?}); mlx.distributed_config --backend jaccl writes them",
                h.rdma
            );
        }
    }
    Ok(())
}

/// The shell line run over ssh for a remote rank: its environment, each of `files` written to
/// a temporary file there and named by its variable, then this program with `args` (as
/// `mlx.launch` does).
fn remote_script(env: &[(String, String)], files: &[(String, String)], exe: &Path, args: &[String]) -> String {
    let quote = |s: &str| format!("'{}'", s.replace('\'', r"'\''"));
    let mut script = String::new();
    for (key, value) in env {
        script += &format!("export {key}={}; ", quote(value));
    }
    for (name, content) in files {
        script += &format!("fname=$(mktemp); echo {} > $fname; export {name}=$fname; ", quote(content));
    }
    let command: Vec<String> = std::iter::once(exe.display().to_string()).chain(args.iter().cloned()).collect();
    script += &format!("exec {}", command.iter().map(|a| quote(a)).collect::<Vec<_>>().join(" "));
    script
}

/// `ferrite follow`: a rank other than 0, started by rank 0 — joins the group, loads its part
/// of the model and runs what rank 0 orders until dismissed.
#[derive(clap::Args)]
pub struct FollowArgs {
    #[arg(long)]
    model: PathBuf,
    #[arg(long, default_value = "sustained")]
    profile: engine::ProfileName,
    #[arg(long, value_enum, default_value = "ring")]
    backend: Backend,
}

pub fn follow(args: FollowArgs) -> Result<()> {
    let group = Arc::new(Group::init(Some(args.backend.name()), true).context("joining the distributed group")?);
    let rank = group.rank();
    let options = server::engine_options::from_env(engine::Profile::named(args.profile), Some(group))?;
    let engine = engine::Engine::load_with(&args.model, &options)
        .with_context(|| format!("rank {rank}: loading {}", args.model.display()))?;
    engine.follow().with_context(|| format!("rank {rank}"))?;
    report_memory(&engine);
    Ok(())
}

/// What this process holds in memory (its part of the weights, once its caches are empty),
/// on stderr: `[rank R of N holds X MB]`, or `[holds X MB]` for a whole model.
pub fn report_memory(engine: &engine::Engine) {
    let held = engine::memory::mlx_memory().active as f64 / 1e6;
    match engine.group() {
        Some(group) => eprintln!("[rank {} of {} holds {held:.3} MB]", group.rank(), group.size()),
        None => eprintln!("[holds {held:.3} MB]"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(ssh: Option<&str>, ip: &str) -> Host {
        Host { ssh: ssh.map(str::to_string), ips: vec![ip.to_string()], rdma: vec![] }
    }

    #[test]
    fn each_backend_gets_the_environment_mlx_launch_would_give() {
        let mut hosts = vec![host(Some("a"), "10.0.0.1"), host(Some("b"), "10.0.0.2")];
        let (env, files) = environment(&hosts, Backend::Ring).unwrap();
        assert!(env.is_empty());
        assert_eq!(files, [("MLX_HOSTFILE".to_string(), r#"[["10.0.0.1:32323"],["10.0.0.2:32324"]]"#.to_string())]);
        let (env, files) = environment(&hosts, Backend::Nccl).unwrap();
        assert!(files.is_empty());
        assert!(env.contains(&("NCCL_HOST_IP".into(), "10.0.0.1".into())), "{env:?}");
        assert!(env.contains(&("MLX_WORLD_SIZE".into(), "2".into())), "{env:?}");
        let err = environment(&hosts, Backend::Jaccl).unwrap_err().to_string();
        assert!(err.contains("rank 0 has []"), "{err}");
        hosts[0].rdma = vec![None, Some("rdma_en3".into())];
        hosts[1].rdma = vec![Some("rdma_en4".into()), None];
        let (env, files) = environment(&hosts, Backend::Jaccl).unwrap();
        assert_eq!(env, [("MLX_JACCL_COORDINATOR".to_string(), "10.0.0.1:32323".to_string())]);
        assert_eq!(files, [("MLX_IBV_DEVICES".to_string(), r#"[[null,"rdma_en3"],["rdma_en4",null]]"#.to_string())]);
    }

    #[test]
    fn loopback_hosts_run_here_and_others_over_ssh() {
        assert!(host(None, "127.0.0.1").is_local());
        assert!(host(Some("localhost"), "127.0.0.1").is_local());
        assert!(!host(Some("mac-studio"), "10.0.0.2").is_local());
        assert!(!host(None, "192.168.1.4").is_local());
    }

    #[test]
    fn each_local_rank_takes_the_next_gpu_of_its_host() {
        let hosts = [host(Some("a"), "10.0.0.1"), host(Some("a"), "10.0.0.1"), host(Some("b"), "10.0.0.2")];
        assert_eq!([0, 1, 2].map(|r| local_gpu(&hosts, r)), [0, 1, 0]);
    }

    #[test]
    fn a_remote_rank_gets_its_environment_and_address_file_in_one_quoted_line() {
        let env = [("MLX_RANK".to_string(), "1".to_string())];
        let files = [("MLX_HOSTFILE".to_string(), r#"[["10.0.0.1:32323"]]"#.to_string())];
        let script = remote_script(&env, &files, &PathBuf::from("/opt/ferrite"), &["follow".into()]);
        assert_eq!(
            script,
            "export MLX_RANK='1'; fname=$(mktemp); echo '[[\"10.0.0.1:32323\"]]' > $fname; \
             export MLX_HOSTFILE=$fname; exec '/opt/ferrite' 'follow'"
        );
    }

    #[test]
    fn a_host_file_needs_two_ranks_with_addresses() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("hosts.json");
        std::fs::write(&file, r#"[{"ssh": "a", "ips": ["10.0.0.1"]}]"#).unwrap();
        assert!(read_hosts(&file).unwrap_err().to_string().contains("at least 2 ranks"));
        std::fs::write(&file, r#"[{"ips": ["127.0.0.1"]}, {"ssh": "b"}]"#).unwrap();
        assert!(read_hosts(&file).unwrap_err().to_string().contains("rank 1 has no \"ips\""));
        std::fs::write(&file, r#"{"hosts": 2}"#).unwrap();
        assert!(read_hosts(&file).unwrap_err().to_string().contains("not a host file"));
        std::fs::write(&file, r#"[{"ips": ["127.0.0.1"]}, {"ips": ["127.0.0.1"]}]"#).unwrap();
        assert_eq!(read_hosts(&file).unwrap().len(), 2);
    }
}
