//! JSON-RPC 2.0 framing for ACP: classifying incoming messages and building
//! responses and errors with the codes of `interfaces.md`.

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

/// An incoming message, classified.
#[derive(Debug, PartialEq)]
pub enum Incoming {
    Request {
        id: Value,
        method: String,
        params: Value,
    },
    Notification {
        method: String,
        params: Value,
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
    params: Option<Value>,
    #[serde(default, deserialize_with = "present")]
    result: Option<Value>,
    #[serde(default, deserialize_with = "present")]
    error: Option<Value>,
}

fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Value>, D::Error> {
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
            params: obj.remove("params"),
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
    let params = params.unwrap_or(Value::Null);
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
                params: Value::Null
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

    proptest::proptest! {
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
