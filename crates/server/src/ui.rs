//! The web UI (`ui/` at the repository root), compiled into the server and served at `/`, so a
//! browser on 127.0.0.1 sees what the app shows.

use axum::http::header;
use axum::response::IntoResponse;

const INDEX: &str = include_str!("../../../ui/index.html");
const SCRIPT: &str = include_str!("../../../ui/app.js");
const STYLE: &str = include_str!("../../../ui/style.css");

pub async fn index() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], INDEX)
}

pub async fn script() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/javascript; charset=utf-8")], SCRIPT)
}

pub async fn style() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/css; charset=utf-8")], STYLE)
}
