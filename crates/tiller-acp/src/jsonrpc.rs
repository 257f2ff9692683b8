//! JSON-RPC 2.0 framing for ACP: classifying incoming messages and building
//! responses and errors with the codes of `interfaces.md`.

use std::borrow::Cow;

use agent_client_protocol_schema::v1::{ContentBlock, PromptRequest, TextContent};
use serde::de::DeserializeOwned;
use serde_json::value::RawValue;
use serde_json::{Value, json};

/// Error codes Tiller answers with.
pub mod code {
    pub const PARSE_ERROR: i64 = -32700;
    pub const INVALID_REQUEST: i64 = -32600;
    pub const METHOD_NOT_FOUND: i64 = -32601;
    pub const INVALID_PARAMS: i64 = -32602;
    pub const INTERNAL_ERROR: i64 = -32603;
    /// The client cancelled the request (`$/cancel_request`).
    pub const REQUEST_CANCELLED: i64 = -32800;
    pub const OVERLOADED: i64 = -32001;
    pub const UNKNOWN_SESSION: i64 = -32002;
}

/// A JSON-RPC error object.
#[derive(Clone, Debug, PartialEq)]
pub struct RpcError {
    pub code: i64,
    pub message: String,
    pub data: Option<Value>,
}

impl RpcError {
    pub fn new(code: i64, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            data: None,
        }
    }

    pub fn with_data(mut self, data: Value) -> Self {
        self.data = Some(data);
        self
    }

    pub fn invalid_params(message: impl std::fmt::Display) -> Self {
        let message = message.to_string();
        RpcError::new(code::INVALID_PARAMS, format!("invalid params: {message}"))
            .with_data(json!({ "error": message }))
    }

    fn to_json(&self) -> Value {
        let mut e = json!({ "code": self.code, "message": self.message });
        if let Some(d) = &self.data {
            e["data"] = d.clone();
        }
        e
    }
}

/// A request's or notification's params as the client sent them (`null`
/// when absent): checked as JSON, read into their type once, by the
/// method's handler, without a `Value` in between.
#[derive(Debug)]
pub struct Params(Box<RawValue>);

impl Params {
    /// No params.
    pub fn null() -> Self {
        Params(RawValue::NULL.to_owned())
    }

    fn of(v: &Value) -> Self {
        // A `Value` always serializes; `null` is only the unreachable case.
        serde_json::value::to_raw_value(v).map_or_else(|_| Params::null(), Params)
    }

    /// The params' JSON text.
    pub fn text(&self) -> &str {
        self.0.get()
    }

    /// The params read into `T`. The error is serde's message without its
    /// position (which would count in the params, not in the frame).
    pub fn read<T: DeserializeOwned>(&self) -> Result<T, String> {
        serde_json::from_str(self.text()).map_err(|e| {
            let why = e.to_string();
            let at = format!(" at line {} column {}", e.line(), e.column());
            match why.strip_suffix(&at) {
                Some(w) if e.line() > 0 => w.to_owned(),
                _ => why,
            }
        })
    }

    /// `session/prompt`'s params. The shape clients send most, a session
    /// and text blocks with nothing else, is read in one pass into plain
    /// structs; any other shape is read by the protocol's own types (whose
    /// internally tagged blocks are read twice), which give its errors.
    pub fn read_prompt(&self) -> Result<PromptRequest, String> {
        #[derive(serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Plain {
            #[serde(rename = "sessionId")]
            session_id: String,
            prompt: Vec<PlainText>,
        }
        #[derive(serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        struct PlainText {
            #[serde(rename = "type")]
            _kind: TextTag,
            text: String,
        }
        #[derive(serde::Deserialize)]
        enum TextTag {
            #[serde(rename = "text")]
            Text,
        }
        if let Ok(p) = serde_json::from_str::<Plain>(self.text()) {
            let blocks = p.prompt.into_iter();
            return Ok(PromptRequest::new(
                p.session_id,
                blocks
                    .map(|b| ContentBlock::Text(TextContent::new(b.text)))
                    .collect(),
            ));
        }
        self.read()
    }

    /// The `sessionId` member when the params are an object holding one
    /// as a string (an array is not read by position).
    pub fn session_id(&self) -> Option<Cow<'_, str>> {
        #[derive(serde::Deserialize)]
        struct Peek<'a> {
            #[serde(rename = "sessionId", borrow, default)]
            session_id: Option<Cow<'a, str>>,
        }
        if !self.text().trim_start().starts_with('{') {
            return None;
        }
        serde_json::from_str::<Peek<'_>>(self.text())
            .ok()
            .and_then(|p| p.session_id)
    }
}

/// Params are equal when their JSON values are (whitespace and the
/// spelling of escapes aside).
impl PartialEq for Params {
    fn eq(&self, other: &Self) -> bool {
        self.read::<Value>().ok() == other.read::<Value>().ok()
    }
}

/// An incoming message, classified.
#[derive(Debug, PartialEq)]
pub enum Incoming {
    Request {
        id: Value,
        method: String,
        params: Params,
    },
    Notification {
        method: String,
        params: Params,
    },
    /// A response to a request we sent.
    Response {
        id: Value,
        result: Result<Value, Value>,
    },
    /// Not JSON-RPC at all: answer with this error (id when one was readable).
    Invalid {
        id: Value,
        error: RpcError,
    },
}

/// The members of a frame that classify it; any other member is ignored.
/// A member given as `null` is `Some(Value::Null)`, not absent.
#[derive(serde::Deserialize)]
struct Frame {
    #[serde(default, deserialize_with = "present")]
    id: Option<Value>,
    #[serde(default, deserialize_with = "present")]
    jsonrpc: Option<Value>,
    #[serde(default, deserialize_with = "present")]
    method: Option<Value>,
    #[serde(default, deserialize_with = "present")]
    params: Option<Box<RawValue>>,
    #[serde(default, deserialize_with = "present")]
    result: Option<Value>,
    #[serde(default, deserialize_with = "present")]
    error: Option<Value>,
}

fn present<'de, D: serde::Deserializer<'de>, T: serde::Deserialize<'de>>(
    d: D,
) -> Result<Option<T>, D::Error> {
    serde::Deserialize::deserialize(d).map(Some)
}

/// Classifies one frame.
pub fn parse(frame: &str) -> Incoming {
    // An object is read straight into its members (every prompt comes this
    // way). Anything else, or an object the members cannot be read from
    // (a member given twice, say), is read as a `Value`, which says why.
    // (Not an array: serde would read one into the members by position.)
    // Members not read are skipped, their values unchecked beyond syntax.
    if frame.trim_start().starts_with('{')
        && let Ok(f) = serde_json::from_str::<Frame>(frame)
    {
        return classify(f);
    }
    parse_value(frame)
}

/// [`parse`] through a `Value`.
fn parse_value(frame: &str) -> Incoming {
    match serde_json::from_str::<Value>(frame) {
        Err(e) => Incoming::Invalid {
            id: Value::Null,
            error: RpcError::new(code::PARSE_ERROR, format!("parse error: {e}")),
        },
        Ok(Value::Object(mut obj)) => classify(Frame {
            id: obj.remove("id"),
            jsonrpc: obj.remove("jsonrpc"),
            method: obj.remove("method"),
            params: obj.remove("params").map(|v| Params::of(&v).0),
            result: obj.remove("result"),
            error: obj.remove("error"),
        }),
        Ok(_) => Incoming::Invalid {
            id: Value::Null,
            error: RpcError::new(
                code::INVALID_REQUEST,
                "invalid request: expected a JSON-RPC object (batches are not supported)",
            ),
        },
    }
}

fn classify(frame: Frame) -> Incoming {
    let Frame {
        id,
        jsonrpc,
        method,
        params,
        result,
        error,
    } = frame;
    if let Some(id) = &id
        && !(id.is_string() || id.is_number() || id.is_null())
    {
        return Incoming::Invalid {
            id: Value::Null,
            error: RpcError::new(code::INVALID_REQUEST, "invalid request: bad `id`"),
        };
    }
    if jsonrpc.as_ref().and_then(Value::as_str) != Some("2.0") {
        return Incoming::Invalid {
            id: id.unwrap_or(Value::Null),
            error: RpcError::new(
                code::INVALID_REQUEST,
                "invalid request: `jsonrpc` must be \"2.0\"",
            ),
        };
    }
    let method = match method {
        Some(Value::String(m)) => m,
        Some(_) => {
            return Incoming::Invalid {
                id: id.unwrap_or(Value::Null),
                error: RpcError::new(
                    code::INVALID_REQUEST,
                    "invalid request: `method` must be a string",
                ),
            };
        }
        None if result.is_some() || error.is_some() => {
            let result = match error {
                Some(e) => Err(e),
                None => Ok(result.unwrap_or(Value::Null)),
            };
            return Incoming::Response {
                id: id.unwrap_or(Value::Null),
                result,
            };
        }
        None => {
            return Incoming::Invalid {
                id: id.unwrap_or(Value::Null),
                error: RpcError::new(code::INVALID_REQUEST, "invalid request: missing `method`"),
            };
        }
    };
    let params = params.map_or_else(Params::null, Params);
    match id {
        Some(id) => Incoming::Request { id, method, params },
        None => Incoming::Notification { method, params },
    }
}

/// A success response (serialized straight, without a `Value` around it:
/// every prompt's answer takes this path).
pub fn response(id: &Value, result: Value) -> String {
    #[derive(serde::Serialize)]
    struct Response<'a> {
        jsonrpc: &'static str,
        id: &'a Value,
        result: &'a Value,
    }
    serde_json::to_string(&Response {
        jsonrpc: "2.0",
        id,
        result: &result,
    })
    .expect("serialize")
}

/// An error response.
pub fn error(id: &Value, error: &RpcError) -> String {
    json!({ "jsonrpc": "2.0", "id": id, "error": error.to_json() }).to_string()
}

/// A request from us to the client.
pub fn request(id: &str, method: &str, params: Value) -> String {
    json!({ "jsonrpc": "2.0", "id": id, "method": method, "params": params }).to_string()
}

/// A request passed on as it came (its params' text unchanged).
pub fn request_of(id: &Value, method: &str, params: &Params) -> String {
    #[derive(serde::Serialize)]
    struct Request<'a> {
        jsonrpc: &'static str,
        id: &'a Value,
        method: &'a str,
        params: &'a RawValue,
    }
    serde_json::to_string(&Request {
        jsonrpc: "2.0",
        id,
        method,
        params: &params.0,
    })
    .expect("serialize")
}

/// A notification.
pub fn notification(method: &str, params: Value) -> String {
    notification_of(method, &params)
}

/// A notification serialized straight from its params' type (no
/// intermediate `Value`: this is the path of every streamed update).
pub fn notification_of<T: serde::Serialize>(method: &str, params: &T) -> String {
    #[derive(serde::Serialize)]
    struct Notification<'a, T> {
        jsonrpc: &'static str,
        method: &'a str,
        params: &'a T,
    }
    serde_json::to_string(&Notification {
        jsonrpc: "2.0",
        method,
        params,
    })
    .expect("serialize")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classification_table() {
        let cases: &[(&str, Option<i64>)] = &[
            (r#"{"jsonrpc":"2.0","id":1,"method":"m","params":{}}"#, None),
            (r#"{"jsonrpc":"2.0","method":"n"}"#, None),
            (r#"{"jsonrpc":"2.0","id":1,"result":{}}"#, None),
            ("{oops", Some(code::PARSE_ERROR)),
            ("[1]", Some(code::INVALID_REQUEST)),
            (r#"{"id":1,"method":"m"}"#, Some(code::INVALID_REQUEST)),
            (
                r#"{"jsonrpc":"2.0","id":1,"method":3}"#,
                Some(code::INVALID_REQUEST),
            ),
            (
                r#"{"jsonrpc":"2.0","id":{},"method":"m"}"#,
                Some(code::INVALID_REQUEST),
            ),
            (r#"{"jsonrpc":"2.0","id":1}"#, Some(code::INVALID_REQUEST)),
        ];
        for (frame, want) in cases {
            let got = match parse(frame) {
                Incoming::Invalid { error, .. } => Some(error.code),
                _ => None,
            };
            assert_eq!(got, *want, "{frame}");
        }
        assert_eq!(
            parse(r#"["2.0", 1, "m"]"#),
            parse_value(r#"["2.0", 1, "m"]"#),
            "an array is not read into the members by position"
        );
        assert_eq!(
            parse(r#"{"jsonrpc":"2.0","id":"a","method":"m"}"#),
            Incoming::Request {
                id: json!("a"),
                method: "m".into(),
                params: Params::null()
            }
        );
    }

    /// Members Tiller does not read are skipped, not read as values: a
    /// number beyond `f64`, a lone surrogate or deep nesting in one does
    /// not make a frame unreadable (the `Value` read refused them), and
    /// serde_json's private raw-value key smuggles no frame in.
    #[test]
    fn unknown_members_are_skipped_not_read() {
        let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
        for extra in ["1e400", "\"\\ud800\"", deep.as_str()] {
            let frame = format!(r#"{{"jsonrpc":"2.0","id":1,"method":"m","x":{extra}}}"#);
            assert!(matches!(parse(&frame), Incoming::Request { .. }), "{frame}");
            assert!(
                matches!(parse_value(&frame), Incoming::Invalid { .. }),
                "{frame}"
            );
        }
        let smuggled = r#"{"$serde_json::private::RawValue":"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"m\"}"}"#;
        assert!(
            matches!(parse(smuggled), Incoming::Invalid { .. }),
            "{smuggled}"
        );
    }

    /// Params of a method's shape: each member absent or one of a few
    /// values (right, wrong type, escaped, `null`), a key maybe spelled
    /// with an escape, in any order; or params that are not an object.
    fn params_text() -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        let members: [(&[&str], &[&str]); 4] = [
            (
                &["sessionId", "session\\u0049d"],
                &["\"s-1\"", "\"\\u0073\"", "1", "null", "[]"],
            ),
            (
                &["prompt"],
                &[
                    "[]",
                    r#"[{"type":"text","text":"hi"}]"#,
                    r#"[{"text":"b","type":"text"},{"type":"text","text":""}]"#,
                    r#"[{"type":"text","text":"hi","_meta":{"k":1}}]"#,
                    r#"[{"type":"text","text":"hi","annotations":{"priority":0.5}}]"#,
                    r#"[{"type":"text","text":"a\"b\\u00e9\n"}]"#,
                    r#"[{"type":"image","data":"eA==","mimeType":"image/png"}]"#,
                    r#"[{"type":"nope"}]"#,
                    r#"[{"text":"no type"}]"#,
                    "{}",
                    "\"x\"",
                    "null",
                ],
            ),
            (&["_meta"], &[r#"{"a":[1,2.5]}"#, "null", "3"]),
            (&["other", "messageId"], &["1", "\"m\"", "{}", "null"]),
        ];
        let object = (
            proptest::collection::vec((0..3usize, 0..10usize), 4),
            proptest::collection::vec(0..8usize, 4),
        )
            .prop_map(move |(picks, order)| {
                let mut out: Vec<String> = Vec::new();
                for (((keys, values), (k, v)), at) in members.iter().zip(&picks).zip(&order) {
                    if *k == 2 {
                        continue; // absent
                    }
                    let key = keys[k % keys.len()];
                    let member = format!("\"{key}\": {}", values[v % values.len()]);
                    out.insert(at % (out.len() + 1), member);
                }
                format!("{{{}}}", out.join(","))
            });
        prop_oneof![
            6 => object,
            1 => proptest::sample::select(&["null", "3", "\"s\"", "[\"s-1\", []]", "[\"s-1\"]", " {\"sessionId\":\"s\"} "][..])
                .prop_map(str::to_owned),
        ]
    }

    /// Params read as the client sent them, through [`Params`].
    fn params_of(text: &str) -> Params {
        let frame = format!(r#"{{"jsonrpc":"2.0","id":1,"method":"m","params":{text}}}"#);
        match parse(&frame) {
            Incoming::Request { params, .. } => params,
            other => panic!("{frame}: {other:?}"),
        }
    }

    /// `read` through a `Value`, as the params were read before.
    fn through_value<T: DeserializeOwned>(text: &str) -> Result<T, String> {
        let v: Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
        serde_json::from_value(v).map_err(|e| e.to_string())
    }

    #[test]
    fn a_params_error_names_no_position() {
        let p = params_of(r#"{"prompt": []}"#);
        let e = p.read::<PromptRequest>().unwrap_err();
        assert_eq!(e, "missing field `sessionId`");
        let p = params_of("{\n\"sessionId\": 3}");
        let e = p
            .read::<agent_client_protocol_schema::v1::CancelNotification>()
            .unwrap_err();
        assert_eq!(e, "invalid type: integer `3`, expected a string");
    }

    #[test]
    fn a_passed_on_request_keeps_its_params_text() {
        let text = r#"{ "sessionId" : "s", "prompt": [{"type":"text","text":"\u00e9"}] }"#;
        let line = request_of(&json!(7), "session/prompt", &params_of(text));
        assert_eq!(
            line,
            format!(r#"{{"jsonrpc":"2.0","id":7,"method":"session/prompt","params":{text}}}"#)
        );
        assert_eq!(
            request_of(&json!("a"), "m", &Params::null()),
            r#"{"jsonrpc":"2.0","id":"a","method":"m","params":null}"#
        );
    }

    proptest::proptest! {
        /// A method's params read straight from their text give what
        /// reading them through a `Value` gave: the same request, or the
        /// same error message; and the same `sessionId` for routing.
        #[test]
        fn params_read_straight_as_through_a_value(text in params_text()) {
            use agent_client_protocol_schema::v1::CancelNotification;
            let p = params_of(&text);
            proptest::prop_assert_eq!(p.read::<PromptRequest>(), through_value::<PromptRequest>(&text), "{}", text);
            proptest::prop_assert_eq!(p.read_prompt(), through_value::<PromptRequest>(&text), "{}", text);
            proptest::prop_assert_eq!(
                p.read::<CancelNotification>(),
                through_value::<CancelNotification>(&text),
                "{}", text
            );
            let v: Value = serde_json::from_str(&text).unwrap();
            let peeked = p.session_id();
            proptest::prop_assert_eq!(
                peeked.as_deref(),
                v.get("sessionId").and_then(Value::as_str),
                "{}", text
            );
            proptest::prop_assert_eq!(p.read::<Value>().ok(), Some(v), "{}", text);
        }

        /// Reading a frame straight into its members classifies it as
        /// reading it through a `Value` does: each member absent, `null`,
        /// right or of the wrong type, in any order, given twice, among
        /// others, or a frame that is not an object or not JSON.
        #[test]
        fn the_direct_read_classifies_as_the_value_read(
            chosen in proptest::collection::vec(0..4usize, 6),
            extra in proptest::collection::vec(
                (
                    proptest::sample::select(
                        &["id", "jsonrpc", "method", "params", "result", "error", "other", "i\\u0064"][..]
                    ),
                    proptest::sample::select(&["null", "1", "\"2.0\"", "{}", "[\"2.0\"]"][..]),
                ),
                0..3,
            ),
            at in proptest::collection::vec(0..8usize, 3),
            shape in 0..4u8,
        ) {
            // Per member: absent, null, a right value, a wrong one.
            let values: [(&str, [&str; 2]); 6] = [
                ("id", ["7", "{}"]),
                ("jsonrpc", ["\"2.0\"", "2"]),
                ("method", ["\"m\"", "[]"]),
                ("params", ["{\"sessionId\":\"s\"}", "3"]),
                ("result", ["{}", "\"r\""]),
                ("error", ["{\"code\":1}", "true"]),
            ];
            let mut members: Vec<String> = values
                .iter()
                .zip(&chosen)
                .filter_map(|((k, v), c)| match c {
                    0 => None,
                    1 => Some(format!("\"{k}\": null")),
                    c => Some(format!("\"{k}\": {}", v[c - 2])),
                })
                .collect();
            for ((k, v), at) in extra.iter().zip(&at) {
                members.insert(at % (members.len() + 1), format!("\"{k}\": {v}"));
            }
            let body = members.join(", ");
            let frame = match shape {
                0 => format!("{{{body}}}"),
                1 => format!("  {{ {body} }}  "),
                2 => format!("[{{{body}}}]"),
                _ => format!("{{{body}"),
            };
            proptest::prop_assert_eq!(parse(&frame), parse_value(&frame), "{}", frame);
        }
    }
}
