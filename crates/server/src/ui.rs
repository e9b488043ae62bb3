//! The web UI (`ui/` at the repository root), compiled into the server and served at `/`, so a
//! browser on 127.0.0.1 sees what the app shows.

use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;

use crate::AppState;

const INDEX: &str = include_str!("../../../ui/index.html");
const SCRIPT: &str = include_str!("../../../ui/app.js");
const STYLE: &str = include_str!("../../../ui/style.css");
const CHARTS: &str = include_str!("../../../ui/charts.js");
/// uPlot, the charts' library (vendored, MIT: `ui/vendor/uplot/`).
const UPLOT_SCRIPT: &str = include_str!("../../../ui/vendor/uplot/uPlot.iife.min.js");
const UPLOT_STYLE: &str = include_str!("../../../ui/vendor/uplot/uPlot.min.css");

/// The page, carrying this launch's control token (its Start, store and Tune buttons need it;
/// other sites cannot read the page: the Host and Origin checks refuse them).
pub async fn index(State(s): State<AppState>) -> impl IntoResponse {
    let page = INDEX.replace(
        r#"<meta name="ferrite-token" content="">"#,
        &format!(r#"<meta name="ferrite-token" content="{}">"#, s.guard.control_token()),
    );
    ([(header::CONTENT_TYPE, "text/html; charset=utf-8"), (header::CACHE_CONTROL, "no-store")], page)
}

pub async fn script() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/javascript; charset=utf-8")], SCRIPT)
}

pub async fn charts() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/javascript; charset=utf-8")], CHARTS)
}

pub async fn style() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/css; charset=utf-8")], STYLE)
}

pub async fn uplot_script() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/javascript; charset=utf-8")], UPLOT_SCRIPT)
}

pub async fn uplot_style() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/css; charset=utf-8")], UPLOT_STYLE)
}
