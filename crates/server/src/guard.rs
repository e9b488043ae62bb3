//! Who may call the server. A server on loopback is reachable by every web page the user
//! opens, so besides the API key (when one is set) every request passes four checks:
//! - Host: only names of this server (loopback names and addresses, the address it is bound
//!   to, and names given with `--allow-host`). A DNS-rebinding page reaches 127.0.0.1 under its
//!   own name, and is refused here.
//! - Origin: a browser request from another origin than the allowed ones (the app's, those
//!   given with `--cors-origin`, and the server's own page) is refused, not merely left
//!   without CORS headers: a "simple" cross-site POST would otherwise still run.
//! - POST bodies must be `Content-Type: application/json`, which a page can only send after a
//!   CORS preflight (text/plain and form posts need none).
//! - Endpoints that change the server (load a model, the store, tuning) need the per-launch
//!   control token, even on loopback: the app and the page this server serves hold it
//!   (`x-ferrite-token`); the OpenAI and Anthropic endpoints stay open to local agents.

use std::net::{IpAddr, SocketAddr};

use axum::extract::{Request, State};
use axum::http::{header, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use subtle::ConstantTimeEq;

use crate::error::ApiError;
use crate::AppState;

/// The header that carries the control token.
pub const TOKEN_HEADER: &str = "x-ferrite-token";

/// The paths whose POSTs change the server's models, store or tuning.
const CONTROL_PATHS: [&str; 7] = [
    "/v1/models/load",
    "/v1/store/pull",
    "/v1/store/cancel",
    "/v1/store/delete",
    "/v1/store/folder",
    "/v1/tune",
    "/v1/tune/cancel",
];

#[derive(Debug, Clone)]
pub struct Guard {
    /// The address the server listens on (an unspecified one accepts any IP-literal Host).
    bind: Option<IpAddr>,
    /// Host names allowed besides loopback and the bound address (`--allow-host`).
    hosts: Vec<String>,
    /// Browser origins allowed besides the server's own page.
    origins: Vec<String>,
    api_key: Option<String>,
    control_token: String,
}

impl Guard {
    /// A guard for a server bound to `bind`, with a fresh control token.
    pub fn new(bind: Option<SocketAddr>, hosts: Vec<String>, origins: Vec<String>, api_key: Option<String>) -> Self {
        Guard {
            bind: bind.map(|a| a.ip()),
            hosts: hosts.into_iter().map(|h| h.to_ascii_lowercase()).collect(),
            origins,
            api_key,
            control_token: new_token(),
        }
    }

    /// A guard for a loopback server with the app's origins.
    pub fn loopback(api_key: Option<String>) -> Self {
        Guard::new(None, vec![], crate::APP_ORIGINS.map(String::from).to_vec(), api_key)
    }

    /// The token the control endpoints need (the app hands it to its window; the page at `/`
    /// carries it).
    pub fn control_token(&self) -> &str {
        &self.control_token
    }

    pub fn api_key_required(&self) -> bool {
        self.api_key.is_some()
    }

    /// Whether `host` (a Host header's value, port included) names this server.
    fn host_allowed(&self, host: &str) -> bool {
        let name = host_name(host).to_ascii_lowercase();
        if name == "localhost" || name.ends_with(".localhost") || self.hosts.contains(&name) {
            return true;
        }
        let Ok(ip) = name.trim_start_matches('[').trim_end_matches(']').parse::<IpAddr>() else { return false };
        ip.is_loopback() || Some(ip) == self.bind || self.bind.is_some_and(|b| b.is_unspecified())
    }

    /// Whether a browser page of `origin` may call the server reached as `host`.
    fn origin_allowed(&self, origin: &str, host: Option<&str>) -> bool {
        self.origins.iter().any(|o| o == origin)
            || host.is_some_and(|h| origin == format!("http://{h}") || origin == format!("https://{h}"))
    }

    fn key_matches(&self, given: &str) -> bool {
        self.api_key.as_deref().is_some_and(|key| bool::from(key.as_bytes().ct_eq(given.as_bytes())))
    }

    fn token_matches(&self, given: &str) -> bool {
        bool::from(self.control_token.as_bytes().ct_eq(given.as_bytes()))
    }
}

/// 32 random bytes, hex.
fn new_token() -> String {
    let mut bytes = [0u8; 32];
    // Without the OS's randomness there is no secret to hand out: a server must not start.
    getrandom::fill(&mut bytes).expect("the operating system's random number source is unavailable");
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A Host header's name without its port (`[::1]:8080` → `[::1]`).
fn host_name(host: &str) -> &str {
    if host.starts_with('[') {
        return host.split_once(']').map(|(name, _)| &host[..name.len() + 1]).unwrap_or(host);
    }
    host.rsplit_once(':').filter(|(_, port)| port.parse::<u16>().is_ok()).map(|(name, _)| name).unwrap_or(host)
}

fn refuse(status: StatusCode, message: String, param: Option<&str>) -> Response {
    ApiError { status, message, param: param.map(str::to_string) }.into_response()
}

/// The checks, before any handler reads the request.
pub async fn check(State(s): State<AppState>, req: Request, next: Next) -> Response {
    let guard = &s.guard;
    let headers = req.headers();
    let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let host = text(header::HOST.as_str());
    if let Some(host) = host.filter(|h| !guard.host_allowed(h)) {
        return refuse(
            StatusCode::FORBIDDEN,
            format!(
                "Host `{host}` does not name this server (loopback names, its address, or one given with --allow-host)"
            ),
            Some("host"),
        );
    }
    if let Some(origin) = text(header::ORIGIN.as_str()).filter(|o| !guard.origin_allowed(o, host)) {
        return refuse(
            StatusCode::FORBIDDEN,
            format!("Origin `{origin}` may not call this server (the app and the page it serves may; add others with --cors-origin)"),
            Some("origin"),
        );
    }
    let path = req.uri().path();
    let page = matches!(path, "/" | "/app.js" | "/style.css");
    if guard.api_key_required() && !page {
        let bearer = text(header::AUTHORIZATION.as_str())
            .and_then(|v| v.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, key)| key.trim());
        let given = bearer.or(text("x-api-key"));
        if !given.is_some_and(|g| guard.key_matches(g)) {
            return refuse(StatusCode::UNAUTHORIZED, "missing or wrong API key".into(), None);
        }
    }
    if req.method() == Method::POST {
        let mime =
            text(header::CONTENT_TYPE.as_str()).map(|c| c.split(';').next().unwrap_or("").trim().to_ascii_lowercase());
        if mime.as_deref() != Some("application/json") {
            return refuse(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                format!(
                    "POST bodies must be sent as `Content-Type: application/json` (got {})",
                    mime.map(|m| format!("`{m}`")).unwrap_or_else(|| "none".into())
                ),
                Some("content-type"),
            );
        }
        if CONTROL_PATHS.contains(&path) && !text(TOKEN_HEADER).is_some_and(|t| guard.token_matches(t)) {
            return refuse(
                StatusCode::FORBIDDEN,
                format!("{path} changes the server: it needs the `{TOKEN_HEADER}` header with this launch's control token (the app and the page at / hold it)"),
                Some(TOKEN_HEADER),
            );
        }
    }
    next.run(req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_names_without_ports() {
        assert_eq!(host_name("127.0.0.1:8080"), "127.0.0.1");
        assert_eq!(host_name("[::1]:8080"), "[::1]");
        assert_eq!(host_name("[::1]"), "[::1]");
        assert_eq!(host_name("localhost"), "localhost");
        assert_eq!(host_name("evil.example:80"), "evil.example");
    }

    #[test]
    fn only_names_of_this_server_are_hosts() {
        let g = Guard::loopback(None);
        for ok in ["127.0.0.1:8080", "localhost:8080", "LOCALHOST", "[::1]:8080", "127.0.0.2", "app.localhost:1"] {
            assert!(g.host_allowed(ok), "{ok}");
        }
        for bad in ["evil.example", "evil.example:8080", "192.168.1.5:8080", "127.0.0.1.evil.example", "[::2]:80", ""] {
            assert!(!g.host_allowed(bad), "{bad}");
        }
        let lan: SocketAddr = "192.168.1.5:8080".parse().unwrap();
        let g = Guard::new(Some(lan), vec!["Mac.local".into()], vec![], Some("k".into()));
        assert!(g.host_allowed("192.168.1.5:8080") && g.host_allowed("mac.local:8080"));
        assert!(!g.host_allowed("192.168.1.6:8080"));
        let any: SocketAddr = "0.0.0.0:8080".parse().unwrap();
        let g = Guard::new(Some(any), vec![], vec![], Some("k".into()));
        assert!(g.host_allowed("10.0.0.3:8080") && !g.host_allowed("evil.example:8080"));
    }

    #[test]
    fn origins_are_the_apps_and_the_servers_own() {
        let g = Guard::loopback(None);
        assert!(g.origin_allowed("tauri://localhost", Some("127.0.0.1:8080")));
        assert!(g.origin_allowed("http://127.0.0.1:8080", Some("127.0.0.1:8080")));
        assert!(!g.origin_allowed("http://127.0.0.1:9999", Some("127.0.0.1:8080")));
        assert!(!g.origin_allowed("https://evil.example", Some("127.0.0.1:8080")));
        assert!(!g.origin_allowed("null", Some("127.0.0.1:8080")));
    }

    #[test]
    fn tokens_are_fresh_and_compared_whole() {
        let (a, b) = (Guard::loopback(None), Guard::loopback(None));
        assert_eq!(a.control_token().len(), 64);
        assert_ne!(a.control_token(), b.control_token());
        assert!(a.token_matches(a.control_token()));
        assert!(!a.token_matches(&a.control_token()[..63]) && !a.token_matches(b.control_token()));
    }
}
