//! The engine's wrapper of MLX's distributed layer connects real processes: two ranks on
//! loopback with the ring backend (the hostfile `mlx.launch` would write), each sees the sum
//! and the gather of both; without a group in the environment a strict start is refused.
//! Then a model split across ranks (`--hosts`): every architecture gives the tokens it gives
//! whole, a killed rank ends the request with a clean error, and `serve` keeps its ranks in
//! step and reports a lost one.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Two distinct free ports (both listeners held until both are chosen).
fn free_ports() -> [u16; 2] {
    let listeners = [(); 2].map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap());
    listeners.map(|l| l.local_addr().unwrap().port())
}

/// Two `ferrite dev collectives` ranks on loopback (the ring hostfile `mlx.launch` would
/// write), waited for at most 120 s: each one's exit status, stdout and stderr.
fn two_ranks(args: &[&str]) -> Vec<(bool, String, String)> {
    let tmp = tempfile::tempdir().unwrap();
    let hostfile = tmp.path().join("hosts.json");
    let ports = free_ports();
    let hosts = serde_json::json!([[format!("127.0.0.1:{}", ports[0])], [format!("127.0.0.1:{}", ports[1])]]);
    std::fs::write(&hostfile, hosts.to_string()).unwrap();
    let mut ranks: Vec<_> = (0..2)
        .map(|rank| {
            Command::new(env!("CARGO_BIN_EXE_ferrite"))
                .args(["dev", "collectives", "--backend", "ring"])
                .args(args)
                .env("MLX_RANK", rank.to_string())
                .env("MLX_HOSTFILE", &hostfile)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    // Bounded: a rank that cannot reach the other must not hang the test.
    let started = Instant::now();
    while ranks.iter_mut().any(|r| r.try_wait().unwrap().is_none()) {
        if started.elapsed() > Duration::from_secs(120) {
            for r in &mut ranks {
                let _ = r.kill();
            }
            let said: Vec<String> = ranks
                .into_iter()
                .map(|r| {
                    let out = r.wait_with_output().unwrap();
                    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
                })
                .collect();
            panic!("the ranks did not finish in 120 s: {said:#?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    ranks
        .into_iter()
        .map(|r| {
            let out = r.wait_with_output().unwrap();
            let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
            (out.status.success(), text(&out.stdout), text(&out.stderr))
        })
        .collect()
}

#[test]
fn two_ranks_on_loopback_sum_and_gather() {
    for (rank, (ok, stdout, stderr)) in two_ranks(&[]).into_iter().enumerate() {
        assert!(ok, "rank {rank}: {stdout}\n{stderr}");
        let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
        assert_eq!(v["rank"], rank, "{v}");
        assert_eq!(v["size"], 2, "{v}");
        assert_eq!(v["sum"], serde_json::json!([3.0, 3.0, 3.0, 3.0]), "1 + 2 on every rank: {v}");
        assert_eq!(v["gathered"], serde_json::json!([0.0, 1.0]), "{v}");
    }
}

/// Rank 1 is killed after the first round: rank 0's next collective ends with a clean error
/// saying the peer was lost (not a hang, not a crash). MLX's ring backend usually raises
/// that error; now and then its collective waits on the dead peer instead (seen under load),
/// and then the round's time limit ends it.
#[test]
fn a_dead_rank_ends_the_others_collectives_with_a_clean_error() {
    let started = Instant::now();
    let ranks = two_ranks(&["--rounds", "3", "--die-after", "1"]);
    let (ok, stdout, stderr) = &ranks[0];
    assert!(!ok, "rank 0 cannot finish three rounds alone: {stdout}");
    assert_eq!(stdout.lines().count(), 1, "one round went through: {stdout}");
    assert!(
        stderr.contains("connection to a peer was lost") || stderr.contains("a peer stopped answering"),
        "{stderr}"
    );
    assert!(started.elapsed() < Duration::from_secs(60), "bounded: {:?}", started.elapsed());
}

/// Rank 1 stops answering after the first round (alive, silent): rank 0's next round ends
/// with an error naming the round within the time limit, instead of waiting for ever.
#[test]
fn a_silent_rank_ends_the_others_collectives_within_the_round_limit() {
    let started = Instant::now();
    let ranks = two_ranks(&["--rounds", "3", "--stall-after", "1"]);
    let (ok, stdout, stderr) = &ranks[0];
    assert!(!ok, "rank 0 cannot finish three rounds alone: {stdout}");
    assert_eq!(stdout.lines().count(), 1, "one round went through: {stdout}");
    assert!(
        stderr.contains("rank 0: round 1's collectives did not return in 15 s: a peer stopped answering"),
        "{stderr}"
    );
    let (ok, _, stderr) = &ranks[1];
    assert!(!ok, "the silent rank ends too, by its own limit: {stderr}");
    assert!(started.elapsed() < Duration::from_secs(60), "bounded: {:?}", started.elapsed());
}

#[test]
fn a_strict_start_without_a_group_is_refused() {
    let out = Command::new(env!("CARGO_BIN_EXE_ferrite"))
        .args(["dev", "collectives", "--backend", "ring"])
        .env_remove("MLX_RANK")
        .env_remove("MLX_HOSTFILE")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("distributed group did not start"), "{err}");
}

// --- A model split across two ranks (`--hosts`, tensor parallelism) ---

fn ferrite(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_ferrite")).args(args).env("RUST_LOG", "warn").output().unwrap()
}

/// A project-made checkpoint of `arch` in `dir` (`extra`: more `make-checkpoint` flags).
fn checkpoint(dir: &std::path::Path, arch: &str, extra: &[&str]) -> String {
    let out = dir.join(arch).display().to_string();
    let made = ferrite(&[&["dev", "make-checkpoint", "--arch", arch, "--out", &out], extra].concat());
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    out
}

/// Two ranks on this machine, as a host file lists them.
fn loopback_hosts(dir: &std::path::Path, ranks: usize) -> String {
    let file = dir.join(format!("hosts-{ranks}.json"));
    std::fs::write(&file, serde_json::to_string(&vec![serde_json::json!({"ips": ["127.0.0.1"]}); ranks]).unwrap())
        .unwrap();
    file.display().to_string()
}

/// Greedy text for `prompt`, alone or split across the ranks of `hosts`.
fn generate(model: &str, depth: &str, hosts: Option<&str>) -> (String, String) {
    let mut args = vec!["generate", "-m", model, "-p", "the ranks agree", "--max-tokens", "24", "--draft-depth", depth];
    if let Some(hosts) = hosts {
        args.extend(["--hosts", hosts]);
    }
    let out = ferrite(&args);
    let (stdout, stderr) =
        (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned());
    assert!(out.status.success(), "{model} (hosts {hosts:?}): {stderr}");
    (stdout, stderr)
}

/// Every architecture split across two ranks gives the tokens it gives whole (greedy; the
/// hybrid with its MTP head drafting too), and each rank holds about half the weights.
#[test]
fn a_model_split_across_two_ranks_gives_the_tokens_it_gives_whole() {
    let tmp = tempfile::tempdir().unwrap();
    let hosts = loopback_hosts(tmp.path(), 2);
    let cases = [
        ("qwen3", vec!["--dtype", "f32"], "0"),
        ("qwen3", vec!["--bits", "4", "--group-size", "32"], "0"),
        ("qwen3_moe", vec!["--dtype", "f32"], "0"),
        ("qwen3_next", vec!["--dtype", "f32", "--mtp"], "2"),
        ("qwen3_5", vec!["--dtype", "f32"], "0"),
        ("qwen3_5_moe", vec!["--dtype", "f32", "--mtp"], "1"),
    ];
    for (i, (arch, extra, depth)) in cases.iter().enumerate() {
        let model = checkpoint(&tmp.path().join(i.to_string()), arch, extra);
        let (whole, _) = generate(&model, depth, None);
        let (split, stderr) = generate(&model, depth, Some(&hosts));
        assert!(stderr.contains("[rank 1 started"), "{arch}: {stderr}");
        assert!(!whole.trim().is_empty(), "{arch}: nothing generated");
        assert_eq!(split, whole, "{arch} {extra:?}: split across two ranks");
        // Each rank holds its part of the layers (embeddings and norms whole on both). In
        // f32 the file's size is what a whole model holds (this CPU dequantizes small
        // quantized ones at load).
        if !extra.contains(&"f32") {
            continue;
        }
        let weights = std::fs::metadata(std::path::Path::new(&model).join("model.safetensors")).unwrap().len();
        for rank in 0..2 {
            let held = held_mb(&stderr, rank).unwrap_or_else(|| panic!("{arch}: rank {rank} said nothing: {stderr}"));
            assert!(held * 1e6 < 0.8 * weights as f64, "{arch}: rank {rank} holds {held} MB of {weights} bytes");
        }
    }
}

/// What `[rank R of N holds X MB]` says for `rank`.
fn held_mb(stderr: &str, rank: usize) -> Option<f64> {
    let line = stderr.lines().find(|l| l.starts_with(&format!("[rank {rank} of ")))?;
    line.split(" holds ").nth(1)?.split(' ').next()?.parse().ok()
}

/// Rank 1 killed while rank 0 streams an answer: rank 0 ends with a clean error naming the
/// lost peer within a bounded time (no hang, no crash), having printed part of the answer.
#[test]
fn a_rank_killed_mid_request_ends_it_with_a_clean_error_on_rank_0() {
    use std::io::{BufRead, Read};
    let tmp = tempfile::tempdir().unwrap();
    let hosts = loopback_hosts(tmp.path(), 2);
    let model = checkpoint(tmp.path(), "qwen3", &["--dtype", "f32"]);
    // The regex keeps the answer going (no end-of-sequence before 3000 letters).
    let mut rank0 = Command::new(env!("CARGO_BIN_EXE_ferrite"))
        .args(["generate", "-m", &model, "-p", "go on", "--max-tokens", "3000", "--draft-depth", "0"])
        .args(["--regex", "[a-z]{3000}", "--hosts", &hosts])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = std::io::BufReader::new(rank0.stderr.take().unwrap());
    let (said, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in stderr.lines().map_while(Result::ok) {
            let _ = said.send(line);
        }
    });
    let pid: u32 = loop {
        let line = lines.recv_timeout(Duration::from_secs(60)).expect("rank 1 was never started");
        if let Some(rest) = line.strip_prefix("[rank 1 started on 127.0.0.1, pid ") {
            break rest.trim_end_matches(']').parse().unwrap();
        }
    };
    // Part of the answer has streamed: the request is under way on both ranks.
    let mut first = [0u8; 8];
    rank0.stdout.as_mut().unwrap().read_exact(&mut first).unwrap();
    assert!(Command::new("kill").args(["-9", &pid.to_string()]).status().unwrap().success());
    let killed = Instant::now();
    let status = loop {
        if let Some(status) = rank0.try_wait().unwrap() {
            break status;
        }
        if killed.elapsed() > Duration::from_secs(60) {
            let _ = rank0.kill();
            panic!("rank 0 still running 60 s after rank 1 was killed");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let stderr: Vec<String> = lines.try_iter().collect();
    let stderr = stderr.join("\n");
    assert!(!status.success(), "rank 0 cannot finish alone: {stderr}");
    assert!(stderr.contains("connection to a peer was lost"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// A model whose heads do not divide across the ranks is refused by name on every rank.
#[test]
fn a_model_that_cannot_be_split_evenly_is_refused_naming_what() {
    let tmp = tempfile::tempdir().unwrap();
    let model = checkpoint(tmp.path(), "qwen3", &["--dtype", "f32"]);
    let out = ferrite(&[
        "generate",
        "-m",
        &model,
        "-p",
        "hi",
        "--max-tokens",
        "4",
        "--hosts",
        &loopback_hosts(tmp.path(), 3),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("cannot be split evenly across 3 ranks"), "{stderr}");
}

/// One HTTP exchange with a local server: the status code and the body.
fn http(port: u16, method: &str, path: &str, body: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut client = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        client,
        "{method} {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut answer = String::new();
    client.read_to_string(&mut answer).unwrap();
    let status = answer.get(9..12).and_then(|s| s.parse().ok()).unwrap_or(0);
    let body = answer.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    (status, body)
}

/// `ferrite serve --hosts`: rank 0 serves what the whole model would answer, the other rank
/// follows (a cancelled stream included, and the prompt cache on both), `/v1/status` shows
/// both ranks; once rank 1 is killed, `/health` and requests say the group is down (503)
/// instead of hanging.
#[test]
fn a_split_model_serves_and_reports_a_lost_rank() {
    use std::io::{BufRead, Read, Write};
    let tmp = tempfile::tempdir().unwrap();
    let hosts = loopback_hosts(tmp.path(), 2);
    let model = checkpoint(tmp.path(), "qwen3_next", &["--dtype", "f32", "--mtp"]);
    let (whole, _) = generate(&model, "2", None);
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut server = Command::new(env!("CARGO_BIN_EXE_ferrite"))
        .args(["serve", "-m", &model, "--port", &port.to_string(), "--hosts", &hosts, "--draft-depth", "2"])
        .args(["--idle-minutes", "0", "--alias", "m"])
        .env("FERRITE_CONFIG_DIR", tmp.path().join("config"))
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = std::io::BufReader::new(server.stderr.take().unwrap());
    let (said, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in stderr.lines().map_while(Result::ok) {
            let _ = said.send(line);
        }
    });
    let deadline = Instant::now() + Duration::from_secs(120);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "the server did not come up");
        assert!(server.try_wait().unwrap().is_none(), "the server exited: {:?}", lines.try_iter().collect::<Vec<_>>());
        std::thread::sleep(Duration::from_millis(100));
    }
    let seen: Vec<String> = lines.try_iter().collect();
    let pid = seen
        .iter()
        .find_map(|l| l.strip_prefix("[rank 1 started on 127.0.0.1, pid "))
        .map(|rest| rest.trim_end_matches(']').to_string())
        .unwrap_or_else(|| panic!("rank 1 was not started: {seen:?}"));

    let ask = r#"{"model":"m","prompt":"the ranks agree","max_tokens":24,"temperature":0}"#;
    let text_of = |body: &str| -> (String, u64) {
        let v: serde_json::Value = serde_json::from_str(body).unwrap_or_else(|_| panic!("{body}"));
        let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
        (v["choices"][0]["text"].as_str().unwrap_or_default().to_string(), cached)
    };
    let (status, body) = http(port, "POST", "/v1/completions", ask);
    assert_eq!(status, 200, "{body}");
    assert_eq!(text_of(&body).0, whole.trim_end_matches('\n'), "split serving answers as the whole model");

    // A stream the client leaves after its first bytes: both ranks stop it at the same step.
    let mut client = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    let long = r#"{"model":"m","prompt":"go on","max_tokens":30000,"stream":true,"ignore_eos":true}"#;
    write!(
        client,
        "POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{long}",
        long.len()
    )
    .unwrap();
    let mut first = [0u8; 512];
    let n = client.read(&mut first).unwrap();
    assert!(String::from_utf8_lossy(&first[..n]).starts_with("HTTP/1.1 200"));
    drop(client);

    // The ranks are still in step, and both kept the first answer's prompt in their caches.
    let (status, body) = http(port, "POST", "/v1/completions", ask);
    assert_eq!(status, 200, "{body}");
    let (text, cached) = text_of(&body);
    assert_eq!(text, whole.trim_end_matches('\n'), "after a cancelled stream");
    assert!(cached > 0, "the prompt cache served part of the prompt: {body}");
    let (_, status_body) = http(port, "GET", "/v1/status", "");
    let ranks = serde_json::from_str::<serde_json::Value>(&status_body).unwrap()["ranks"].clone();
    assert_eq!(ranks["count"], 2, "{ranks}");
    assert_eq!(ranks["state"], "up", "{ranks}");
    let memory: Vec<u64> = serde_json::from_value(ranks["memory_bytes"].clone()).unwrap();
    assert!(memory.len() == 2 && memory.iter().all(|&b| b > 0), "{ranks}");
    let (_, metrics) = http(port, "GET", "/metrics", "");
    assert!(metrics.contains("ferrite_ranks_up 1"), "{metrics}");
    assert!(metrics.contains("ferrite_rank_memory_bytes{rank=\"1\"}"), "{metrics}");

    assert!(Command::new("kill").args(["-9", &pid]).status().unwrap().success());
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (status, body) = http(port, "GET", "/health", "");
        if status == 503 {
            assert!(body.contains("connection to a peer was lost"), "{body}");
            break;
        }
        assert!(Instant::now() < deadline, "/health still says {status} {body} 30 s after rank 1 died");
        std::thread::sleep(Duration::from_millis(200));
    }
    let (status, body) = http(port, "POST", "/v1/completions", ask);
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("down"), "{body}");
    let (_, metrics) = http(port, "GET", "/metrics", "");
    assert!(metrics.contains("ferrite_ranks_up 0"), "{metrics}");
    let _ = server.kill();
    let _ = server.wait();
}

/// A rank that cannot start (an unreachable host) is an error naming it, not a wait for it.
#[test]
fn a_rank_that_never_joins_is_an_error_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let model = checkpoint(tmp.path(), "qwen3", &["--dtype", "f32"]);
    let hosts = tmp.path().join("unreachable.json");
    let entries = serde_json::json!([{"ips": ["127.0.0.1"]}, {"ssh": "unreachable.invalid", "ips": ["10.255.255.1"]}]);
    std::fs::write(&hosts, entries.to_string()).unwrap();
    let started = Instant::now();
    let out = ferrite(&["generate", "-m", &model, "-p", "hi", "--max-tokens", "4", "--hosts", hosts.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("rank 1"), "{stderr}");
    assert!(started.elapsed() < Duration::from_secs(100), "{:?}", started.elapsed());
}
