//! What a web page the user opens could send to Ferrite on loopback, and what it gets: a
//! DNS-rebinding page (its own Host name), cross-site "simple" POSTs (text/plain, forms: no
//! CORS preflight), another Origin, the control endpoints without the launch's token. Also the
//! bounds on work per request: the body limit, the queue, subnormal temperatures.

mod common;

use common::{chat, post, start, start_configured};
use reqwest::header::{CONTENT_TYPE, HOST, ORIGIN};
use serde_json::{json, Value};
use server::guard::TOKEN_HEADER;

/// The endpoints that change the server, with a body each accepts.
fn control_requests() -> Vec<(&'static str, Value)> {
    vec![
        ("/v1/models/load", json!({"model": "tiny"})),
        ("/v1/store/pull", json!({"model": "test/none"})),
        ("/v1/store/cancel", json!({"model": "test/none"})),
        ("/v1/store/delete", json!({"model": "test/none"})),
        ("/v1/store/folder", json!({"dir": "/tmp/ferrite-hostile-folder"})),
        ("/v1/tune", json!({"tokens": 8, "reps": 1})),
        ("/v1/tune/cancel", json!({})),
    ]
}

async fn error_of(r: reqwest::Response) -> (u16, String, Value) {
    let status = r.status().as_u16();
    let v: Value = r.json().await.unwrap();
    (status, v["error"]["message"].as_str().unwrap_or_default().to_string(), v["error"]["param"].clone())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_rebinding_page_is_refused_by_its_host_name() {
    let s = start(None).await;
    let client = reqwest::Client::new();
    let port = s.base.rsplit(':').next().unwrap().to_string();
    for path in ["/v1/status", "/v1/store", "/v1/models", "/"] {
        let r =
            client.get(format!("{}{path}", s.base)).header(HOST, format!("evil.example:{port}")).send().await.unwrap();
        let (status, message, param) = error_of(r).await;
        assert_eq!(status, 403, "{path}");
        assert!(message.contains("evil.example") && message.contains("--allow-host"), "{message}");
        assert_eq!(param, "host");
    }
    let r = client
        .post(format!("{}/v1/chat/completions", s.base))
        .header(HOST, "attacker.test")
        .json(&chat(json!({})))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    // Loopback names are this server.
    for host in [format!("127.0.0.1:{port}"), format!("localhost:{port}"), format!("[::1]:{port}")] {
        let r = client.get(format!("{}/v1/status", s.base)).header(HOST, host.clone()).send().await.unwrap();
        assert_eq!(r.status(), 200, "{host}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn posts_a_page_can_send_without_a_preflight_are_refused() {
    let config = tempfile::tempdir().unwrap();
    let config_dir = config.path().to_path_buf();
    let s = start_configured(None, Default::default(), move |state| {
        state.store = server::models::StoreAccess::new(Some(config_dir), None)
    })
    .await;
    let client = reqwest::Client::new();
    // text/plain and form bodies, as <form> and fetch(no-cors) send them: never parsed.
    for (path, body) in [
        ("/v1/chat/completions", chat(json!({})).to_string()),
        ("/v1/store/folder", json!({"dir": "/tmp/ferrite-hostile-folder"}).to_string()),
        ("/v1/models/load", json!({"model": "tiny"}).to_string()),
    ] {
        for content_type in ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"] {
            let r = client
                .post(format!("{}{path}", s.base))
                .header(CONTENT_TYPE, content_type)
                .header(TOKEN_HEADER, s.state.guard.control_token())
                .body(body.clone())
                .send()
                .await
                .unwrap();
            let (status, message, param) = error_of(r).await;
            assert_eq!(status, 415, "{path} as {content_type}");
            assert!(message.contains("application/json") && message.contains(content_type.split(';').next().unwrap()));
            assert_eq!(param, "content-type");
        }
    }
    let r =
        client.post(format!("{}/v1/chat/completions", s.base)).body(chat(json!({})).to_string()).send().await.unwrap();
    assert_eq!(error_of(r).await.0, 415, "no content type at all");
    assert!(std::fs::read_dir(config.path()).unwrap().next().is_none(), "nothing was written to the config");
    assert!(!std::path::Path::new("/tmp/ferrite-hostile-folder").exists());
    // With application/json (charset allowed) the API works.
    let r = client
        .post(format!("{}/v1/chat/completions", s.base))
        .header(CONTENT_TYPE, "application/json; charset=utf-8")
        .body(chat(json!({})).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}

#[tokio::test(flavor = "multi_thread")]
async fn another_origin_is_refused_the_apps_and_the_pages_own_are_not() {
    let s = start(None).await;
    let client = reqwest::Client::new();
    // `tauri.localhost` is the app's origin on Windows only; elsewhere any local page can
    // have it.
    let others: &[&str] = if cfg!(windows) { &[] } else { &["http://tauri.localhost", "https://tauri.localhost"] };
    for origin in ["https://evil.example", "null", "http://127.0.0.1:1"].iter().chain(others) {
        let origin = *origin;
        let r = client
            .post(format!("{}/v1/chat/completions", s.base))
            .header(ORIGIN, origin)
            .json(&chat(json!({})))
            .send()
            .await
            .unwrap();
        let (status, message, param) = error_of(r).await;
        assert_eq!(status, 403, "{origin}");
        assert!(message.contains(origin), "{message}");
        assert_eq!(param, "origin");
    }
    let own = s.base.clone();
    for origin in ["tauri://localhost", own.as_str()] {
        let r = client
            .post(format!("{}/v1/chat/completions", s.base))
            .header(ORIGIN, origin)
            .json(&chat(json!({})))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{origin}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_control_endpoints_need_the_launch_token_which_the_page_carries() {
    let s = start(None).await;
    let client = reqwest::Client::new();
    for (path, body) in control_requests() {
        for token in [None, Some("0".repeat(64)), Some(s.state.guard.control_token()[..63].to_string())] {
            let mut r = client.post(format!("{}{path}", s.base)).json(&body);
            if let Some(t) = &token {
                r = r.header(TOKEN_HEADER, t);
            }
            let (status, message, param) = error_of(r.send().await.unwrap()).await;
            assert_eq!(status, 403, "{path} with {token:?}");
            assert!(message.contains(TOKEN_HEADER), "{message}");
            assert_eq!(param, TOKEN_HEADER);
        }
    }
    assert!(!std::path::Path::new("/tmp/ferrite-hostile-folder").exists());
    // The page at / carries the token, and is not cached.
    let r = client.get(format!("{}/", s.base)).send().await.unwrap();
    assert_eq!(r.headers()["cache-control"], "no-store");
    let page = r.text().await.unwrap();
    assert!(page.contains(&format!(r#"<meta name="ferrite-token" content="{}">"#, s.state.guard.control_token())));
    // With it, the endpoints run (a cancel with nothing to cancel answers 200).
    assert_eq!(post(&s, "/v1/tune/cancel", &json!({})).await.0, 200);
    // The OpenAI and Anthropic endpoints need no token on loopback (agents).
    assert_eq!(
        client.post(format!("{}/v1/chat/completions", s.base)).json(&chat(json!({}))).send().await.unwrap().status(),
        200
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_api_key_takes_any_bearer_spelling_and_nothing_else() {
    let s = start(Some("sekrit")).await;
    let client = reqwest::Client::new();
    let url = format!("{}/v1/models", s.base);
    for (header, ok) in [
        ("Bearer sekrit", true),
        ("bearer sekrit", true),
        ("BEARER sekrit", true),
        ("Bearer sekri", false),
        ("Bearer sekrit2", false),
        ("Basic sekrit", false),
        ("sekrit", false),
    ] {
        let r = client.get(&url).header("authorization", header).send().await.unwrap();
        assert_eq!(r.status() == 200, ok, "{header}: {}", r.status());
    }
    // The page carries the control token, so with a key it needs the key too.
    assert_eq!(client.get(format!("{}/", s.base)).send().await.unwrap().status(), 401);
    let r = client.get(format!("{}/", s.base)).header("x-api-key", "sekrit").send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.text().await.unwrap().contains(s.state.guard.control_token()));
}

/// A schema whose references chain `n` deep (each definition refers to the next): ~24 KB at
/// 700 overflowed the engine thread's stack while llguidance compiled it, aborting the process.
fn chained_refs(n: usize) -> Value {
    let mut defs = serde_json::Map::new();
    for i in 0..n {
        defs.insert(format!("d{i}"), json!({"$ref": format!("#/$defs/d{}", i + 1)}));
    }
    defs.insert(format!("d{n}"), json!({"type": "string"}));
    json!({"type": "object", "properties": {"a": {"$ref": "#/$defs/d0"}}, "required": ["a"], "$defs": defs})
}

/// An object with `n` required properties.
fn many_required(n: usize) -> Value {
    let names: Vec<String> = (0..n).map(|i| format!("p{i}")).collect();
    let properties: serde_json::Map<String, Value> =
        names.iter().map(|p| (p.clone(), json!({"type": "integer"}))).collect();
    json!({"type": "object", "properties": properties, "required": names})
}

#[tokio::test(flavor = "multi_thread")]
async fn a_schema_too_large_to_compile_is_a_400_in_every_api_and_the_server_lives() {
    let s = start(None).await;
    let deep_lark = format!("start: {}\"a\"{}", "(".repeat(5000), ")".repeat(5000));
    for (what, schema) in [("700 chained $refs", chained_refs(700)), ("7,000 required properties", many_required(7000))]
    {
        let requests = [
            (
                "/v1/chat/completions",
                chat(
                    json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}),
                ),
                Some("response_format.json_schema"),
            ),
            (
                "/v1/chat/completions",
                chat(
                    json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}], "tool_choice": "required"}),
                ),
                Some("tools"),
            ),
            (
                "/v1/responses",
                json!({"model": "tiny", "input": "hi", "max_output_tokens": 8, "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}}),
                Some("text.format.schema"),
            ),
            (
                "/v1/messages",
                json!({"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                       "tools": [{"name": "f", "input_schema": schema}], "tool_choice": {"type": "any"}}),
                None,
            ),
        ];
        for (path, body, param) in requests {
            let (status, v) = post(&s, path, &body).await;
            assert_eq!(status, 400, "{what} at {path}: {v}");
            let message = v["error"]["message"].as_str().unwrap_or_default();
            assert!(message.contains("too large to enforce"), "{what} at {path}: {message}");
            if let Some(param) = param {
                assert_eq!(v["error"]["param"], param, "{what} at {path}");
            }
            // Still alive, still answering.
            assert_eq!(post(&s, "/v1/chat/completions", &chat(json!({}))).await.0, 200, "{what} at {path}");
        }
    }
    let (status, v) = post(
        &s,
        "/v1/chat/completions",
        &chat(json!({"response_format": {"type": "grammar", "syntax": "lark", "definition": deep_lark}})),
    )
    .await;
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("response_format.definition")), "{v}");
    // A schema within the limits, its references chained 60 deep, is held to, not refused.
    let (status, v) = post(
        &s,
        "/v1/chat/completions",
        &chat(json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": chained_refs(60)}}})),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let health = reqwest::get(format!("{}/health", s.base)).await.unwrap();
    assert_eq!(health.status(), 200);
}

#[tokio::test(flavor = "multi_thread")]
async fn no_page_may_frame_the_server() {
    let s = start(None).await;
    for path in ["/", "/v1/status", "/app.js"] {
        let r = reqwest::get(format!("{}{path}", s.base)).await.unwrap();
        assert_eq!(r.headers()["x-frame-options"], "DENY", "{path}");
        assert_eq!(r.headers()["content-security-policy"], "frame-ancestors 'none'", "{path}");
    }
}

/// The status code of a request written byte for byte.
async fn raw_status(base: &str, request: &[u8]) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut c = tokio::net::TcpStream::connect(base.trim_start_matches("http://")).await.unwrap();
    c.write_all(request).await.unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n") && head.len() < 200 {
        match tokio::time::timeout(std::time::Duration::from_secs(20), c.read(&mut byte)).await {
            Ok(Ok(1)) => head.push(byte[0]),
            _ => break,
        }
    }
    let line = String::from_utf8_lossy(&head);
    line.split(' ').nth(1).and_then(|code| code.parse().ok()).unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread")]
async fn host_forms_a_browser_cannot_send_are_refused() {
    let s = start(None).await;
    let ok = b"GET /v1/status HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
    assert_eq!(raw_status(&s.base, ok).await, 200);
    for (what, request) in [
        ("no Host", b"GET /v1/status HTTP/1.1\r\nConnection: close\r\n\r\n".to_vec()),
        (
            "two Hosts",
            b"GET /v1/status HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: evil.example\r\nConnection: close\r\n\r\n".to_vec(),
        ),
        (
            "a non-ASCII Host",
            b"GET /v1/status HTTP/1.1\r\nHost: 127.0.0.1\xc3\xa9.evil\r\nConnection: close\r\n\r\n".to_vec(),
        ),
        (
            "text after an IPv6 literal",
            b"GET /v1/status HTTP/1.1\r\nHost: [::1]evil.example\r\nConnection: close\r\n\r\n".to_vec(),
        ),
        (
            "an authority other than the Host",
            b"GET http://evil.example/v1/status HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".to_vec(),
        ),
        (
            "an authority that is not this server's",
            b"GET http://evil.example/v1/status HTTP/1.1\r\nHost: evil.example\r\nConnection: close\r\n\r\n".to_vec(),
        ),
    ] {
        let status = raw_status(&s.base, &request).await;
        assert!(status == 400 || status == 403, "{what}: {status}");
    }
    assert_eq!(raw_status(&s.base, ok).await, 200);
}

#[tokio::test(flavor = "multi_thread")]
async fn bodies_over_the_limit_get_a_413_that_names_it() {
    let s = start(None).await;
    let r = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", s.base))
        .header(CONTENT_TYPE, "application/json")
        .body("x".repeat(server::MAX_BODY_BYTES + 1))
        .send()
        .await
        .unwrap();
    let (status, message, _) = error_of(r).await;
    assert_eq!(status, 413);
    assert!(message.contains("4 MiB"), "{message}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_full_queue_answers_429_with_retry_after() {
    // One sequence at a time: a second request waits instead of joining the batch.
    let profile = engine::Profile { max_sequences: 1, ..Default::default() };
    let options = server::worker::WorkerOptions { max_queued: Some(1), profile, ..Default::default() };
    let s = start_configured(None, options, |_| {}).await;
    let client = reqwest::Client::new();
    let long = chat(json!({"max_tokens": 4000, "ignore_eos": true, "stream": true}));
    // One runs, one waits; the third finds the queue full.
    let running = client.post(format!("{}/v1/chat/completions", s.base)).json(&long).send().await.unwrap();
    assert_eq!(running.status(), 200);
    let base = s.base.clone();
    let body = long.clone();
    let waiting = tokio::spawn(async move {
        reqwest::Client::new().post(format!("{base}/v1/chat/completions")).json(&body).send().await
    });
    let queue = || s.state.loaded().worker.queue_depth.load(std::sync::atomic::Ordering::SeqCst);
    for _ in 0..200 {
        if queue() == 1 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(queue(), 1);
    let r = client.post(format!("{}/v1/chat/completions", s.base)).json(&chat(json!({}))).send().await.unwrap();
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "1");
    let (_, message, _) = error_of(r).await;
    assert!(message.contains("waiting"), "{message}");
    let r = client
        .post(format!("{}/v1/messages", s.base))
        .json(&json!({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    assert_eq!(r.json::<Value>().await.unwrap()["error"]["type"], "rate_limit_error");
    drop(running);
    waiting.abort();
    // Once the clients are gone the queue drains and requests are served again.
    for _ in 0..500 {
        if queue() == 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(post(&s, "/v1/chat/completions", &chat(json!({}))).await.0, 200);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_subnormal_temperature_is_greedy() {
    let s = start(None).await;
    let greedy = post(&s, "/v1/chat/completions", &chat(json!({"temperature": 0}))).await.1;
    for t in [1e-40, 1e-30, 1e-6] {
        let v = post(&s, "/v1/chat/completions", &chat(json!({"temperature": t}))).await.1;
        assert_eq!(v["choices"][0]["message"], greedy["choices"][0]["message"], "temperature {t}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn half_sent_requests_and_idle_connections_are_dropped() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let app = axum::Router::new().route("/", axum::routing::get(|| async { "ok" }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let timeout = std::time::Duration::from_millis(500);
    tokio::spawn(server::connections::serve_with(listener, app, std::future::pending(), timeout));
    // 200 clients that send half a request head and then nothing.
    let mut slow = Vec::new();
    for _ in 0..200 {
        let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
        c.write_all(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n").await.unwrap();
        slow.push(c);
    }
    // A whole request is still answered meanwhile.
    let r = reqwest::get(format!("http://{addr}/")).await.unwrap();
    assert_eq!(r.text().await.unwrap(), "ok");
    // Each half-sent connection is closed by the server (EOF, or an error response then EOF).
    for mut c in slow {
        let mut buf = Vec::new();
        let read = tokio::time::timeout(std::time::Duration::from_secs(20), c.read_to_end(&mut buf)).await;
        assert!(read.is_ok(), "a half-sent request kept its connection open");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn idle_http2_connections_and_stalled_bodies_are_dropped() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let app = axum::Router::new()
        .route("/", axum::routing::get(|| async { "ok" }))
        .route("/body", axum::routing::post(|body: axum::body::Bytes| async move { format!("{} bytes", body.len()) }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let timeout = std::time::Duration::from_millis(500);
    tokio::spawn(server::connections::serve_with(listener, app, std::future::pending(), timeout));
    // h2c with prior knowledge: the preface and an empty SETTINGS frame, then nothing (the
    // server answers pings, so without an idle timeout these stay open for good).
    let mut idle = Vec::new();
    for _ in 0..100 {
        let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
        c.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00").await.unwrap();
        idle.push(c);
    }
    // A body that stops after 10 of its 100 bytes.
    let mut stalled = tokio::net::TcpStream::connect(addr).await.unwrap();
    stalled
        .write_all(b"POST /body HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n0123456789")
        .await
        .unwrap();
    // Meanwhile a whole request is answered.
    let r = reqwest::get(format!("http://{addr}/")).await.unwrap();
    assert_eq!(r.text().await.unwrap(), "ok");
    for mut c in idle {
        let mut buf = Vec::new();
        let read = tokio::time::timeout(std::time::Duration::from_secs(20), c.read_to_end(&mut buf)).await;
        assert!(read.is_ok(), "an idle HTTP/2 connection was kept open");
    }
    let mut answer = Vec::new();
    let read = tokio::time::timeout(std::time::Duration::from_secs(20), stalled.read_to_end(&mut answer)).await;
    assert!(read.is_ok(), "a stalled body kept its request open");
    let answer = String::from_utf8_lossy(&answer);
    assert!(!answer.contains("100 bytes"), "{answer}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_stops_reading_is_let_go() {
    use server::job::{JobEvent, Prompt};
    use server::worker::WorkerOptions;
    let stall = std::time::Duration::from_millis(300);
    let s = common::start_full_options(WorkerOptions { client_stall: Some(stall), ..Default::default() }).await;
    let worker = s.state.loaded().worker.clone();
    let request = engine::GenerateRequest { ignore_eos: true, ..engine::GenerateRequest::greedy(vec![], 100_000) };
    // A streaming client that takes nothing of its answer (its socket full, its process stopped).
    let mut running = worker.run(Prompt::Text("fn main() {".into()), request, false).await.unwrap();
    let max_tokens = running.max_tokens;
    assert!(max_tokens > 500, "{max_tokens}");
    // It is cancelled long before its answer would end; the events it left are still there.
    let ended = tokio::time::timeout(std::time::Duration::from_secs(120), async {
        loop {
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            if s.state.loaded().worker.metrics.streams().is_empty() {
                break;
            }
        }
    })
    .await;
    assert!(ended.is_ok(), "the request kept generating for a client that took nothing");
    let mut generated = None;
    while let Ok(event) = running.events.try_recv() {
        if let JobEvent::Finished { summary, .. } = event {
            generated = Some((summary.usage.completion_tokens, summary.finish_reason));
        }
    }
    let (tokens, reason) = generated.expect("the job finished");
    assert_eq!(reason, engine::FinishReason::Cancelled);
    assert!(tokens < max_tokens, "{tokens} of {max_tokens}");
    // The server answers the next request at once.
    assert_eq!(post(&s, "/v1/chat/completions", &chat(json!({}))).await.0, 200);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_prompt_that_cannot_fit_is_refused_before_it_is_rendered() {
    let s = start(None).await;
    let huge = "fn main() {} ".repeat(300_000); // 3.9 MB, under the body limit
    let (status, v) =
        post(&s, "/v1/chat/completions", &chat(json!({"messages": [{"role": "user", "content": huge}]}))).await;
    assert_eq!(status, 400);
    let message = v["error"]["message"].as_str().unwrap();
    assert!(message.contains("at least") && message.contains("40960"), "{message}");
    // The engine is free again at once: the next request is answered.
    assert_eq!(post(&s, "/v1/chat/completions", &chat(json!({}))).await.0, 200);
}
