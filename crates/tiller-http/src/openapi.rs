//! The OpenAPI 3.1 description of `/api`, generated from the handlers'
//! annotations and the types in `wire.rs`. Served at `/api/openapi.json`
//! and committed as `docs/openapi.json` (a test keeps the two equal).

use utoipa::openapi::path::Operation;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::{ContentBuilder, Ref, RefOr, ResponseBuilder};
use utoipa::{Modify, OpenApi};

use crate::wire::*;
use crate::{api, channels};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "Tiller HTTP API",
        description = "Sessions, prompts, steering, cancel, history and the resumable event stream \
of a Tiller daemon, as the Web Shell and admin tools use them. Every route takes the daemon's \
token (`Authorization: Bearer TOKEN`) but the channel route, which takes a signature. Every \
state-changing request (POST, PUT, PATCH, DELETE), with a body or not, is sent with \
`Content-Type: application/json` (a guard against cross-site requests). Errors are \
`{\"error\": {\"errorKind\", \"message\"}}`; clients branch on `errorKind`.",
        license(name = "Apache-2.0", identifier = "Apache-2.0"),
    ),
    paths(
        api::list_sessions,
        api::create_session,
        api::get_session,
        api::update_session,
        api::close_session,
        api::list_engines,
        api::get_options,
        api::set_option,
        api::post_prompt,
        api::post_compact,
        api::post_steer,
        api::post_cancel,
        api::post_permission,
        api::get_history,
        api::events,
        api::post_notification,
        api::get_goal,
        api::put_goal,
        api::delete_goal,
        api::pause_goal,
        api::resume_goal,
        api::list_cron,
        api::add_cron,
        api::remove_cron,
        channels::post_prompt,
    ),
    components(schemas(Usage, Cost, OptionInfo, Snapshot, Envelope)),
    modifiers(&Common),
    security(("token" = [])),
    tags(
        (name = "sessions", description = "Sessions, their state, history and event stream"),
        (name = "turns", description = "Prompts, steering, cancel and permissions"),
        (name = "engines", description = "The engines sessions may use"),
        (name = "automation", description = "Notifications, goals, cron jobs and channels"),
    )
)]
pub struct ApiDoc;

/// The bearer token scheme, and the error answers every route may give.
struct Common;

impl Modify for Common {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        let components = doc.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "token",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(
                        "The daemon's token (`<data_dir>/token` or `server.token`)",
                    ))
                    .build(),
            ),
        );
        let error = |why: &str| {
            ResponseBuilder::new()
                .description(why)
                .content(
                    "application/json",
                    ContentBuilder::new()
                        .schema(Some(Ref::from_schema_name("ErrorResponse")))
                        .build(),
                )
                .build()
        };
        let common = [
            ("400", "Invalid parameters or body"),
            ("401", "No or wrong token (or signature)"),
            ("404", "No such session, goal, job or request"),
            ("413", "The body is over limits.max_body_bytes"),
            (
                "503",
                "Overloaded, the store cannot record the request, or another node serves the session; retry",
            ),
        ];
        for item in doc.paths.paths.values_mut() {
            let ops: [(&mut Option<Operation>, bool); 5] = [
                (&mut item.get, false),
                (&mut item.post, true),
                (&mut item.put, true),
                (&mut item.patch, true),
                (&mut item.delete, true),
            ];
            for (op, changes) in ops {
                let Some(op) = op else { continue };
                // A response without a description is not valid OpenAPI.
                for (code, response) in &mut op.responses.responses {
                    if let RefOr::T(r) = response
                        && r.description.is_empty()
                    {
                        r.description = match code.as_str() {
                            "200" => "OK",
                            "201" => "Created",
                            _ => "Accepted",
                        }
                        .to_owned();
                    }
                }
                for (code, why) in common {
                    op.responses
                        .responses
                        .entry(code.to_owned())
                        .or_insert_with(|| error(why).into());
                }
                if changes {
                    op.responses
                        .responses
                        .entry("415".to_owned())
                        .or_insert_with(|| {
                            error("Not sent with `Content-Type: application/json`").into()
                        });
                }
            }
        }
    }
}

/// The description as `/api/openapi.json` serves it and
/// `docs/openapi.json` holds it (pretty, with a final newline).
pub fn json() -> String {
    let mut s = ApiDoc::openapi()
        .to_pretty_json()
        .expect("the description serializes");
    s.push('\n');
    s
}

#[cfg(test)]
mod tests {
    #[test]
    fn docs_openapi_json_is_the_generated_description() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/openapi.json");
        let want = super::json();
        if std::env::var_os("TILLER_BLESS").is_some() {
            std::fs::write(path, &want).unwrap();
        }
        let have = std::fs::read_to_string(path).unwrap_or_default();
        assert!(
            have == want,
            "docs/openapi.json is out of date: run `TILLER_BLESS=1 cargo test -p tiller-http openapi`"
        );
        let doc: serde_json::Value = serde_json::from_str(&want).unwrap();
        assert!(doc["openapi"].as_str().unwrap().starts_with("3.1"));
        // Every /api route the router serves is described (the SSE stream too).
        let routes = include_str!("lib.rs");
        let mut seen = 0;
        for (at, _) in routes.match_indices("\"/api/") {
            let path = routes[at + 1..].split('"').next().unwrap();
            if path != "/api/openapi.json" {
                seen += 1;
                assert!(
                    doc["paths"].get(path).is_some(),
                    "{path} is not in the description"
                );
            }
        }
        assert!(seen >= 19, "{seen} routes found in lib.rs");
    }
}
