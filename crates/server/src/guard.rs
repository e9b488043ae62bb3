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

    /// Compared as SHA-256 digests, so neither the bytes nor the key's length leak through
    /// the comparison's time.
    fn key_matches(&self, given: &str) -> bool {
        use sha2::{Digest, Sha256};
        self.api_key
            .as_deref()
            .is_some_and(|key| bool::from(Sha256::digest(key.as_bytes()).ct_eq(&Sha256::digest(given.as_bytes()))))
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

/// A Host header's name without its port (`[::1]:8080` → `[::1]`). Anything after an IPv6
/// literal's `]` but a port leaves the whole value, which then names no allowed host
/// (`[::1]evil.example`).
fn host_name(host: &str) -> &str {
    if host.starts_with('[') {
        return match host.split_once(']') {
            Some((name, "")) => &host[..name.len() + 1],
            Some((name, rest)) if rest.strip_prefix(':').is_some_and(|p| p.parse::<u16>().is_ok()) => {
                &host[..name.len() + 1]
            }
            _ => host,
        };
    }
    host.rsplit_once(':').filter(|(_, port)| port.parse::<u16>().is_ok()).map(|(name, _)| name).unwrap_or(host)
}

/// The name the request was sent to: its one Host header, or HTTP/2's `:authority` (in the
/// URI); both must agree where both are given. A request without one, with several, with
/// bytes that are not visible ASCII, or whose two names differ, names no host: a browser never
/// sends such a thing, a proxy or a hand-made request may, and none of them is trusted.
fn request_host(req: &Request) -> Result<Option<String>, String> {
    let mut headers = req.headers().get_all(header::HOST).iter();
    let header = match (headers.next(), headers.next()) {
        (Some(_), Some(_)) => return Err("several Host headers".into()),
        (Some(value), None) => Some(
            value
                .to_str()
                .ok()
                .filter(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_graphic()))
                .ok_or_else(|| "a Host header that is not a plain ASCII name".to_string())?,
        ),
        (None, _) => None,
    };
    let authority = req.uri().authority().map(|a| a.as_str());
    match (header, authority) {
        (Some(h), Some(a)) if !h.eq_ignore_ascii_case(a) => {
            Err(format!("a Host header (`{h}`) that differs from the request's authority (`{a}`)"))
        }
        (Some(h), _) => Ok(Some(h.to_string())),
        (None, Some(a)) => Ok(Some(a.to_string())),
        (None, None) => Ok(None),
    }
}

fn refuse(status: StatusCode, message: String, param: Option<&str>) -> Response {
    ApiError { param: param.map(str::to_string), ..ApiError::new(status, message) }.into_response()
}

/// The checks, before any handler reads the request.
pub async fn check(State(s): State<AppState>, req: Request, next: Next) -> Response {
    let guard = &s.guard;
    let headers = req.headers();
    let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let host = match request_host(&req) {
        Ok(Some(host)) => host,
        Ok(None) => return refuse(StatusCode::BAD_REQUEST, "the request names no Host".into(), Some("host")),
        Err(why) => return refuse(StatusCode::BAD_REQUEST, format!("the request has {why}: refused"), Some("host")),
    };
    if !guard.host_allowed(&host) {
        return refuse(
            StatusCode::FORBIDDEN,
            format!(
                "Host `{host}` does not name this server (loopback names, its address, or one given with --allow-host)"
            ),
            Some("host"),
        );
    }
    let host = Some(host.as_str());
    if let Some(origin) = text(header::ORIGIN.as_str()).filter(|o| !guard.origin_allowed(o, host)) {
        return refuse(
            StatusCode::FORBIDDEN,
            format!("Origin `{origin}` may not call this server (the app and the page it serves may; add others with --cors-origin)"),
            Some("origin"),
        );
    }
    let path = req.uri().path();
    // With an API key the page needs it too: the page carries the control token, which only
    // a holder of the key may be handed (and without the key the page's calls fail anyway).
    if guard.api_key_required() {
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
    let mut response = next.run(req).await;
    forbid_framing(response.headers_mut());
    response
}

/// No page of another site may show this server's pages in a frame: the page carries the
/// control token, and a framing page could steer the user's clicks onto its buttons.
fn forbid_framing(headers: &mut axum::http::HeaderMap) {
    headers.insert(header::X_FRAME_OPTIONS, header::HeaderValue::from_static("DENY"));
    headers.insert(header::CONTENT_SECURITY_POLICY, header::HeaderValue::from_static("frame-ancestors 'none'"));
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
        assert_eq!(host_name("[::1]evil.example"), "[::1]evil.example");
        assert_eq!(host_name("[::1]:80evil"), "[::1]:80evil");
    }

    #[test]
    fn only_names_of_this_server_are_hosts() {
        let g = Guard::loopback(None);
        for ok in ["127.0.0.1:8080", "localhost:8080", "LOCALHOST", "[::1]:8080", "127.0.0.2", "app.localhost:1"] {
            assert!(g.host_allowed(ok), "{ok}");
        }
        for bad in [
            "[::1]evil.example",
            "[::1]:8080.evil.example",
            "evil.example",
            "evil.example:8080",
            "192.168.1.5:8080",
            "127.0.0.1.evil.example",
            "[::2]:80",
            "",
        ] {
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

    proptest::proptest! {
        /// Whatever a Host header says, it is allowed only when the name it gives is loopback.
        #[test]
        fn only_loopback_names_pass_whatever_the_spelling(host in "[\\[\\]:.a-zA-Z0-9%@/\\\\-]{0,40}") {
            let g = Guard::loopback(None);
            if g.host_allowed(&host) {
                let name = host_name(&host).to_ascii_lowercase();
                let bare = name.trim_start_matches('[').trim_end_matches(']');
                proptest::prop_assert!(
                    name == "localhost" || name.ends_with(".localhost") || bare.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback()),
                    "{} passed as {}", host, name
                );
                proptest::prop_assert!(!name.contains('/') && !name.contains('@'), "{}", host);
            }
        }
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
