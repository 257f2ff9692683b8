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

/// Classifies one frame.
pub fn parse(frame: &str) -> Incoming {
    let value: Value = match serde_json::from_str(frame) {
        Ok(v) => v,
        Err(e) => {
            return Incoming::Invalid {
                id: Value::Null,
                error: RpcError::new(code::PARSE_ERROR, format!("parse error: {e}")),
            };
        }
    };
    let Value::Object(mut obj) = value else {
        return Incoming::Invalid {
            id: Value::Null,
            error: RpcError::new(
                code::INVALID_REQUEST,
                "invalid request: expected a JSON-RPC object (batches are not supported)",
            ),
        };
    };
    let id = obj.remove("id");
    if let Some(id) = &id
        && !(id.is_string() || id.is_number() || id.is_null())
    {
        return Incoming::Invalid {
            id: Value::Null,
            error: RpcError::new(code::INVALID_REQUEST, "invalid request: bad `id`"),
        };
    }
    if obj.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
        return Incoming::Invalid {
            id: id.unwrap_or(Value::Null),
            error: RpcError::new(
                code::INVALID_REQUEST,
                "invalid request: `jsonrpc` must be \"2.0\"",
            ),
        };
    }
    let method = match obj.remove("method") {
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
        None if obj.contains_key("result") || obj.contains_key("error") => {
            let result = match obj.remove("error") {
                Some(e) => Err(e),
                None => Ok(obj.remove("result").unwrap_or(Value::Null)),
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
    let params = obj.remove("params").unwrap_or(Value::Null);
    match id {
        Some(id) => Incoming::Request { id, method, params },
        None => Incoming::Notification { method, params },
    }
}

/// A success response.
pub fn response(id: &Value, result: Value) -> String {
    json!({ "jsonrpc": "2.0", "id": id, "result": result }).to_string()
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
            parse(r#"{"jsonrpc":"2.0","id":"a","method":"m"}"#),
            Incoming::Request {
                id: json!("a"),
                method: "m".into(),
                params: Value::Null
            }
        );
    }
}
