//! The Web Shell's assets, embedded in the binary (plain ES modules, no
//! build step).

use axum::http::header;
use axum::response::{IntoResponse, Response};

const INDEX: &str = include_str!("../web/index.html");
const APP: &str = include_str!("../web/app.js");
const I18N: &str = include_str!("../web/i18n.js");
const STYLE: &str = include_str!("../web/style.css");

/// Paths of the assets (served without a token: they hold no data).
pub const PATHS: &[&str] = &["/", "/app.js", "/i18n.js", "/style.css"];

fn asset(body: &'static str, kind: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, kind),
            (header::CACHE_CONTROL, "no-cache"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        body,
    )
        .into_response()
}

pub async fn index() -> Response {
    asset(INDEX, "text/html; charset=utf-8")
}

pub async fn app() -> Response {
    asset(APP, "text/javascript; charset=utf-8")
}

pub async fn i18n() -> Response {
    asset(I18N, "text/javascript; charset=utf-8")
}

pub async fn style() -> Response {
    asset(STYLE, "text/css; charset=utf-8")
}
