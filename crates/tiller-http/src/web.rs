//! The Web Shell's assets, embedded in the binary (plain ES modules, no
//! build step).

use axum::http::header;
use axum::response::{IntoResponse, Response};

const INDEX: &str = include_str!("../web/index.html");
const APP: &str = include_str!("../web/app.js");
const I18N: &str = include_str!("../web/i18n.js");
const STYLE: &str = include_str!("../web/style.css");

/// Third-party modules, unchanged from npm (see `web/vendor/README.md`).
const VENDOR: &[(&str, &str)] = &[
    ("marked.esm.js", include_str!("../web/vendor/marked.esm.js")),
    ("purify.es.mjs", include_str!("../web/vendor/purify.es.mjs")),
    (
        "highlight.min.js",
        include_str!("../web/vendor/highlight.min.js"),
    ),
];

/// Paths of the assets (served without a token: they hold no data).
pub const PATHS: &[&str] = &[
    "/",
    "/app.js",
    "/i18n.js",
    "/style.css",
    "/vendor/marked.esm.js",
    "/vendor/purify.es.mjs",
    "/vendor/highlight.min.js",
];

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

/// A vendored module; 404 for any other name.
pub async fn vendor(axum::extract::Path(name): axum::extract::Path<String>) -> Response {
    match VENDOR.iter().find(|(n, _)| *n == name) {
        Some((_, body)) => asset(body, "text/javascript; charset=utf-8"),
        None => axum::http::StatusCode::NOT_FOUND.into_response(),
    }
}
