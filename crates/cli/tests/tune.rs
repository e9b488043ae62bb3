//! `ferrite tune` end to end on a project-made hybrid with an MTP head: it measures, stores a
//! result that `--show` lists and `serve --draft-depth auto` uses, and a corrupt tuning file
//! is set aside and rebuilt. The spread and load checks are opened wide here: their rules
//! are unit-tested in engine::tune, and a test machine's load is not this test's subject.

use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use engine::checkpoint::{self, Architecture, MakeOptions};

fn ferrite(config: &std::path::Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ferrite"));
    c.env("FERRITE_CONFIG_DIR", config).env("RUST_LOG", "warn");
    c
}

fn get(port: u16, path: &str) -> Option<String> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nhost: localhost\r\n\r\n").ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out)
}

#[test]
fn tune_stores_shows_serves_and_survives_a_corrupt_file() {
    let tmp = tempfile::tempdir().unwrap();
    let (config, model) = (tmp.path().join("config"), tmp.path().join("model"));
    let mut o = MakeOptions::new(Architecture::Qwen35, "tiny");
    o.mtp = true;
    checkpoint::make(&o, &model).unwrap();

    let out = ferrite(&config)
        .args([
            "tune",
            "--model",
            model.to_str().unwrap(),
            "--prompts",
            "1",
            "--tokens",
            "8",
            "--rounds",
            "2",
            "--budget",
            "30",
            "--busy-percent",
            "100000",
        ])
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    // Random weights accept no drafts: plain decoding is what gets stored.
    assert!(stdout.contains("stored plain decoding"), "{stdout}");
    let rows = ["plain decoding".to_string()].into_iter().chain((1..=4).map(|d| format!("MTP depth {d}")));
    for row in rows {
        assert!(stdout.lines().any(|l| l.trim_start().starts_with(&format!("{row} "))), "no row for {row}: {stdout}");
    }
    // Batching's gains are measured too (the sustained profile decodes up to 4 together).
    assert!(
        stdout.contains("plain decoding of several requests together") && stdout.contains("4 together"),
        "{stdout}"
    );
    let show = ferrite(&config).args(["tune", "--show"]).output().unwrap();
    let show = String::from_utf8_lossy(&show.stdout);
    assert!(show.contains("model#") && show.contains("sustained") && show.contains("plain decoding"), "{show}");

    // `serve --draft-depth auto` (the default) reports the tuned result.
    let port = 20000 + (std::process::id() % 20000) as u16;
    let mut server = ferrite(&config)
        .args(["serve", "--model", model.to_str().unwrap(), "--port", &port.to_string(), "--idle-minutes", "0"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = get(port, "/v1/status") {
            break s;
        }
        assert!(Instant::now() < deadline, "the server did not come up");
        std::thread::sleep(Duration::from_millis(100));
    };
    let _ = server.kill();
    let _ = server.wait();
    assert!(status.contains("\"draft_depth\":0") && status.contains("tuned 20"), "{status}");
    let body = status.split_once("\r\n\r\n").map_or("", |(_, body)| body);
    let status: serde_json::Value = serde_json::from_str(body).unwrap();
    let rule = &status["batching"]["speculation_or_batch"];
    assert_eq!(rule["measured"], true, "the server did not read the tuned gains: {rule}");
    assert_eq!(rule["batch_gains"].as_array().map(Vec::len), Some(2), "2 and 4 together: {rule}");

    std::fs::write(config.join("tuning.json"), "{ broken").unwrap();
    let show = ferrite(&config).args(["tune", "--show"]).output().unwrap();
    assert!(show.status.success());
    assert!(String::from_utf8_lossy(&show.stderr).contains("corrupt"));
    assert!(String::from_utf8_lossy(&show.stdout).contains("no tuning results"));
    assert!(config.join("tuning.json.corrupt").exists());
}

/// `--class` tunes one workload class (its suite, its temperature) and stores the depth under
/// it; `--show` lists the class; an unknown class is refused, named, before anything loads.
#[test]
fn tune_for_a_class_stores_under_it() {
    let tmp = tempfile::tempdir().unwrap();
    let (config, model) = (tmp.path().join("config"), tmp.path().join("model"));
    let mut o = MakeOptions::new(Architecture::Qwen35, "tiny");
    o.mtp = true;
    checkpoint::make(&o, &model).unwrap();
    let tune = |class: &str| {
        ferrite(&config)
            .args(["tune", "--model", model.to_str().unwrap(), "--class", class])
            .args(["--prompts", "1", "--tokens", "8", "--rounds", "2", "--budget", "30", "--busy-percent", "100000"])
            .output()
            .unwrap()
    };
    let bad = tune("poetry/greedy");
    assert!(!bad.status.success());
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(err.contains("--class") && err.contains("poetry/greedy") && err.contains("agent/sampled"), "{err}");

    let out = tune("agent/greedy");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("for the agent/greedy class"), "{stdout}");
    let show = ferrite(&config).args(["tune", "--show"]).output().unwrap();
    let show = String::from_utf8_lossy(&show.stdout);
    assert!(show.contains("| agent/greedy |"), "{show}");
}
