//! JSON-RPC 2.0 framing for ACP: classifying incoming messages and building
//! responses and errors with the codes of `interfaces.md`.

use std::borrow::Cow;

use agent_client_protocol_schema::v1::{ContentBlock, PromptRequest, TextContent};
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

/// A request's params.
#[derive(Debug)]
pub enum Params {
    /// `session/prompt`'s params in the shape clients send most, an object
    /// holding a session and text blocks and nothing else: read straight
    /// from the frame into the request, without a `Value` in between.
    Prompt(PromptRequest),
    /// Any other params (`null` when absent).
    Value(Value),
}

impl Params {
    /// The params as a `Value`.
    pub fn into_value(self) -> Value {
        match self {
            Params::Prompt(p) => serde_json::to_value(p).unwrap_or(Value::Null),
            Params::Value(v) => v,
        }
    }

    fn as_value(&self) -> Cow<'_, Value> {
        match self {
            Params::Prompt(p) => Cow::Owned(serde_json::to_value(p).unwrap_or(Value::Null)),
            Params::Value(v) => Cow::Borrowed(v),
        }
    }

    /// The `sessionId` the params name (a string member of an object).
    pub fn session_id(&self) -> Option<&str> {
        match self {
            Params::Prompt(p) => Some(&p.session_id.0),
            Params::Value(v) => v.get("sessionId").and_then(Value::as_str),
        }
    }
}

/// Params are equal when their JSON values are.
impl PartialEq for Params {
    fn eq(&self, other: &Self) -> bool {
        self.as_value() == other.as_value()
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
#[serde(bound(deserialize = "P: serde::Deserialize<'de>"))]
struct Frame<P> {
    #[serde(default, deserialize_with = "present")]
    id: Option<Value>,
    #[serde(default, deserialize_with = "present")]
    jsonrpc: Option<Value>,
    #[serde(default, deserialize_with = "present")]
    method: Option<Value>,
    #[serde(default, deserialize_with = "present")]
    params: Option<P>,
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

/// `session/prompt`'s params when they are an object of a session and
/// text blocks with nothing else; `None` for any other shape (or text a
/// `Value` read would refuse), which is read as a `Value`.
fn plain_prompt(params: &RawValue) -> Option<PromptRequest> {
    serde_json::from_str::<PlainPrompt>(params.get())
        .ok()
        .map(|p| p.0)
}

/// A member read into its slot: an error when it was given already (as a
/// derived struct refuses it).
fn once<T, E: serde::de::Error>(slot: &mut Option<T>, v: T) -> Result<(), E> {
    match slot {
        Some(_) => Err(E::custom("a member given twice")),
        None => {
            *slot = Some(v);
            Ok(())
        }
    }
}

/// `session/prompt`'s params in the shape clients send most: an object of
/// `sessionId` and text blocks, each member once, nothing else. Any other
/// shape is an error here (and is read through a `Value`). Objects only:
/// a derived struct would also take an array by position.
struct PlainPrompt(PromptRequest);

impl<'de> serde::Deserialize<'de> for PlainPrompt {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = PlainPrompt;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a prompt of text blocks")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<PlainPrompt, A::Error> {
                #[derive(serde::Deserialize)]
                #[serde(field_identifier)]
                enum Field {
                    #[serde(rename = "sessionId")]
                    SessionId,
                    #[serde(rename = "prompt")]
                    Prompt,
                }
                let (mut session, mut blocks) = (None, None);
                while let Some(field) = map.next_key::<Field>()? {
                    match field {
                        Field::SessionId => once(&mut session, map.next_value::<String>()?)?,
                        Field::Prompt => once(&mut blocks, map.next_value::<Vec<PlainText>>()?)?,
                    }
                }
                let (Some(session), Some(blocks)) = (session, blocks) else {
                    return Err(serde::de::Error::custom("a member is missing"));
                };
                let blocks = blocks.into_iter();
                Ok(PlainPrompt(PromptRequest::new(
                    session,
                    blocks
                        .map(|b| ContentBlock::Text(TextContent::new(b.0)))
                        .collect(),
                )))
            }
        }
        d.deserialize_map(V)
    }
}

/// `{"type": "text", "text": ..}`, an object only (a derived struct would
/// take an array by position, and an enum tag an object).
struct PlainText(String);

impl<'de> serde::Deserialize<'de> for PlainText {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = PlainText;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a text block")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<PlainText, A::Error> {
                #[derive(serde::Deserialize)]
                #[serde(field_identifier)]
                enum Field {
                    #[serde(rename = "type")]
                    Type,
                    #[serde(rename = "text")]
                    Text,
                }
                use serde::de::Error;
                let (mut kind, mut text) = (None, None);
                while let Some(field) = map.next_key::<Field>()? {
                    match field {
                        Field::Type => once(&mut kind, map.next_value::<String>()?)?,
                        Field::Text => once(&mut text, map.next_value::<String>()?)?,
                    }
                }
                match (kind, text) {
                    (Some(k), Some(t)) if k == "text" => Ok(PlainText(t)),
                    _ => Err(A::Error::custom("not a text block")),
                }
            }
        }
        d.deserialize_map(V)
    }
}

/// A frame's params as first read: a prompt's in the plain shape, read
/// straight when its method came before them (as clients write it), or
/// any params kept as text.
enum FirstRead<'a> {
    Prompt(PromptRequest),
    Raw(&'a RawValue),
}

/// A frame read in one pass (see [`FirstRead`]); as a derived `Frame`, a
/// member given twice is an error, and any other member is skipped.
struct OnePass<'a>(Frame<FirstRead<'a>>);

impl<'de> serde::Deserialize<'de> for OnePass<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = OnePass<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON-RPC object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<OnePass<'de>, A::Error> {
                #[derive(serde::Deserialize)]
                #[serde(field_identifier, rename_all = "lowercase")]
                enum Field {
                    Id,
                    Jsonrpc,
                    Method,
                    Params,
                    Result,
                    Error,
                    #[serde(other)]
                    Other,
                }
                let mut f = Frame {
                    id: None,
                    jsonrpc: None,
                    method: None,
                    params: None,
                    result: None,
                    error: None,
                };
                while let Some(field) = map.next_key::<Field>()? {
                    match field {
                        Field::Id => once(&mut f.id, map.next_value()?)?,
                        Field::Jsonrpc => once(&mut f.jsonrpc, map.next_value()?)?,
                        Field::Method => once(&mut f.method, map.next_value()?)?,
                        Field::Params => {
                            let prompt =
                                f.method.as_ref().and_then(Value::as_str) == Some("session/prompt");
                            let p = if prompt {
                                FirstRead::Prompt(map.next_value::<PlainPrompt>()?.0)
                            } else {
                                FirstRead::Raw(map.next_value()?)
                            };
                            once(&mut f.params, p)?;
                        }
                        Field::Result => once(&mut f.result, map.next_value()?)?,
                        Field::Error => once(&mut f.error, map.next_value()?)?,
                        Field::Other => {
                            map.next_value::<serde::de::IgnoredAny>()?;
                        }
                    }
                }
                Ok(OnePass(f))
            }
        }
        d.deserialize_map(V)
    }
}

/// Classifies one frame.
pub fn parse(frame: &str) -> Incoming {
    // An object is read straight into its members (every prompt comes this
    // way). Anything else, or an object the members cannot be read from
    // (a member given twice, say), is read as a `Value`, which says why.
    // (Not an array: the fallback's derived read would take one into the
    // members by position.)
    // Members not read are skipped, their values unchecked beyond syntax.
    // A prompt's plain params are read straight into it, others into a
    // `Value` once the method is known (text that it refuses makes the
    // frame's `Value` read say why, as before).
    if !frame.trim_start().starts_with('{') {
        return parse_value(frame);
    }
    // In one pass when it can be (a plain prompt whose method comes
    // first, or any other frame), else with its params kept as text.
    let f = match serde_json::from_str::<OnePass<'_>>(frame) {
        Ok(OnePass(f)) => f,
        Err(_) => match serde_json::from_str::<Frame<&RawValue>>(frame) {
            Ok(f) => Frame {
                id: f.id,
                jsonrpc: f.jsonrpc,
                method: f.method,
                params: f.params.map(FirstRead::Raw),
                result: f.result,
                error: f.error,
            },
            Err(_) => return parse_value(frame),
        },
    };
    let prompt = f.method.as_ref().and_then(Value::as_str) == Some("session/prompt");
    let params = match f.params {
        None => None,
        Some(FirstRead::Prompt(p)) => Some(Params::Prompt(p)),
        Some(FirstRead::Raw(raw)) => match prompt.then(|| plain_prompt(raw)).flatten() {
            Some(p) => Some(Params::Prompt(p)),
            // Inside brackets: nested as deep as inside the frame, so the
            // recursion limit is met where the frame's read met it.
            None => match serde_json::from_str::<(Value,)>(&format!("[{}]", raw.get())) {
                Ok((v,)) => Some(Params::Value(v)),
                Err(_) => return parse_value(frame),
            },
        },
    };
    classify(Frame {
        id: f.id,
        jsonrpc: f.jsonrpc,
        method: f.method,
        params,
        result: f.result,
        error: f.error,
    })
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
            params: obj.remove("params").map(Params::Value),
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

fn classify(frame: Frame<Params>) -> Incoming {
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
    let params = params.unwrap_or(Params::Value(Value::Null));
    match id {
        Some(id) => Incoming::Request { id, method, params },
        None => Incoming::Notification {
            method,
            params: params.into_value(),
        },
    }
}

/// A success response (serialized straight, without a `Value` around it:
/// every prompt's answer takes this path).
pub fn response<T: serde::Serialize + ?Sized>(id: &Value, result: &T) -> String {
    #[derive(serde::Serialize)]
    struct Response<'a, T: ?Sized> {
        jsonrpc: &'static str,
        id: &'a Value,
        result: &'a T,
    }
    serde_json::to_string(&Response {
        jsonrpc: "2.0",
        id,
        result,
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
                params: Params::Value(Value::Null)
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

    /// `session/prompt` params: each member absent or one of a few values
    /// (right, wrong type, escaped, `null`, given twice), a key maybe
    /// spelled with an escape, in any order; or params that are not an
    /// object, or that a `Value` read refuses.
    fn prompt_params() -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        let members: [(&[&str], &[&str]); 4] = [
            (
                &["sessionId", "session\\u0049d"],
                &[
                    "\"s-1\"",
                    "\"s-1\"",
                    "\"s-1\"",
                    "\"\\u0073\"",
                    "1",
                    "null",
                    "[]",
                    "\"\\ud83d\"",
                ],
            ),
            (
                &["prompt"],
                &[
                    "[]",
                    r#"[{"type":"text","text":"hi"}]"#,
                    r#"[{"text":"b","type":"text"},{"type":"text","text":""}]"#,
                    r#"[{"type":"text","text":"a\"b\\u00e9\n"}]"#,
                    r#"[{"type":"text","text":"x","text":"y"}]"#,
                    r#"[{"type":"text","text":"\ud83d"}]"#,
                    r#"[{"type":"text","text":"hi","_meta":{"k":1}}]"#,
                    r#"[{"type":"text","text":"hi","annotations":{"priority":0.5}}]"#,
                    r#"[{"type":"image","text":"x"}]"#,
                    r#"[{"type":"Text","text":"x"}]"#,
                    r#"[{"type":{"text":null},"text":"x"}]"#,
                    r#"[["text","x"]]"#,
                    r#"[{"type":"te\u0078t","text":"x"},{"type":"text","type":"text","text":"y"}]"#,
                    r#"[{"type":"image","data":"eA==","mimeType":"image/png"}]"#,
                    r#"[{"type":"nope"}]"#,
                    r#"[{"text":"no type"}]"#,
                    "{}",
                    "\"x\"",
                    "null",
                ],
            ),
            (&["_meta"], &[r#"{"a":[1,2.5]}"#, "null", "3", "1e400"]),
            (&["other", "sessionId"], &["1", "\"m\"", "{}", "null"]),
        ];
        // In eighths: how often each member is there (the plain shape,
        // a session and text blocks alone, comes often).
        let present = [7, 7, 2, 2];
        let object = (
            proptest::collection::vec((0..8usize, 0..2usize, 0..19usize), 4),
            proptest::collection::vec(0..8usize, 4),
        )
            .prop_map(move |(picks, order)| {
                let mut out: Vec<String> = Vec::new();
                for ((((keys, values), (there, k, v)), at), p) in
                    members.iter().zip(&picks).zip(&order).zip(present)
                {
                    if *there >= p {
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
            1 => proptest::sample::select(&["null", "3", "[\"s-1\", []]", "[\"s-1\"]", r#"["s-1",[{"type":"text","text":"hi"}]]"#][..])
                .prop_map(str::to_owned),
        ]
    }

    /// A member given twice is read as through a `Value` (the last one),
    /// even when the first is one a `Value` read refuses: the frame is
    /// refused as a whole, as it always was.
    #[test]
    fn a_member_given_twice_is_read_as_through_a_value() {
        let plain = r#"{"sessionId":"s-1","prompt":[{"type":"text","text":"hi"}]}"#;
        for method in ["m", "session/prompt"] {
            for first in ["1e400", "\"\\ud800\"", "{}", plain, "null"] {
                for member in ["params", "method", "id", "jsonrpc"] {
                    let frame = format!(
                        r#"{{"jsonrpc":"2.0","id":1,"method":"{method}","params":{first},"{member}":{plain}}}"#
                    );
                    assert_eq!(parse(&frame), parse_value(&frame), "{frame}");
                }
            }
        }
    }

    /// Params nested near serde_json's recursion limit meet it where the
    /// frame's `Value` read does.
    #[test]
    fn deep_params_are_refused_as_through_a_value() {
        for method in ["m", "session/prompt"] {
            for depth in 124..130 {
                for (open, close) in [("[", "]"), ("{\"a\":", "}")] {
                    let params = format!("{}1{}", open.repeat(depth), close.repeat(depth));
                    let frame = format!(
                        r#"{{"jsonrpc":"2.0","id":1,"method":"{method}","params":{params}}}"#
                    );
                    assert_eq!(
                        parse(&frame),
                        parse_value(&frame),
                        "{method} {depth} {open}"
                    );
                }
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(1024))]

        /// A prompt's params read straight into the request give what
        /// reading them through a `Value` gives: the same classification,
        /// the same request, the same session to route it by.
        #[test]
        fn a_prompt_read_straight_is_the_prompt_read_through_a_value(
            text in prompt_params(),
            spaced in proptest::bool::ANY,
            params_first in proptest::bool::ANY,
        ) {
            let sep = if spaced { " " } else { "" };
            // Read in one pass when the method comes first, else with the
            // params kept as text until it is known.
            let frame = if params_first {
                format!(r#"{{"jsonrpc":"2.0","params":{sep}{text}{sep},"id":1,"method":"session/prompt"}}"#)
            } else {
                format!(r#"{{"jsonrpc":"2.0","id":1,"method":"session/prompt","params":{sep}{text}{sep}}}"#)
            };
            let (direct, value) = (parse(&frame), parse_value(&frame));
            proptest::prop_assert_eq!(&direct, &value, "{}", frame);
            if let (
                Incoming::Request { params, .. },
                Incoming::Request { params: Params::Value(v), .. },
            ) = (direct, value)
            {
                proptest::prop_assert_eq!(
                    params.session_id(),
                    v.get("sessionId").and_then(Value::as_str),
                    "{}", frame
                );
                // What the handler reads: the request, or the same error.
                let through = serde_json::from_value::<PromptRequest>(v).map_err(|e| e.to_string());
                match params {
                    Params::Prompt(p) => proptest::prop_assert_eq!(Ok(p), through, "{}", frame),
                    Params::Value(d) => proptest::prop_assert_eq!(
                        serde_json::from_value::<PromptRequest>(d).map_err(|e| e.to_string()),
                        through,
                        "{}", frame
                    ),
                }
            }
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
