// Every message the daemon sends an ACP test client is checked against the
// official ACP v1 JSON schema (`schema/acp-v1.schema.json`, the one the
// pinned `@agentclientprotocol/sdk` ships; a test keeps the two equal).
// Requests and notifications are checked by method, responses by the
// method of the request they answer, errors as JSON-RPC errors. A test file
// that received any message that does not validate fails in its `after`.

import fs from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { after } from "node:test";
import assert from "node:assert/strict";
import Ajv2020 from "ajv/dist/2020.js";

const here = path.dirname(fileURLToPath(import.meta.url));
export const schemaPath = path.join(here, "../schema/acp-v1.schema.json");
const schema = JSON.parse(fs.readFileSync(schemaPath, "utf8"));

const ajv = new Ajv2020({ strict: false, allErrors: true, validateFormats: false });
ajv.addSchema(schema, "acp");

/** `$defs` name per method and role, from the schema's own `x-method`. */
const defs = {};
for (const [name, def] of Object.entries(schema.$defs)) {
  const method = def?.["x-method"];
  if (!method) continue;
  const role = name.endsWith("Response") ? "response" : name.endsWith("Notification") ? "notification" : "request";
  (defs[method] ??= {})[role] = name;
}
const validators = new Map();
function validator(def) {
  if (!validators.has(def)) validators.set(def, ajv.getSchema(`acp#/$defs/${def}`));
  return validators.get(def);
}

/** Messages that did not validate, for the file's `after` check. */
export const violations = [];
let checked = 0;

after(() => {
  assert.deepEqual(
    violations,
    [],
    `${violations.length} of ${checked} daemon messages violate the ACP schema`,
  );
});

function check(def, value) {
  const v = validator(def);
  if (!v) return [`no definition ${def} in the schema`];
  return v(value) ? [] : [`${def}: ${ajv.errorsText(v.errors.slice(0, 5))}`];
}

/**
 * What is wrong with one message from the daemon (nothing: `[]`). `sent`
 * maps the ids of the client's requests to their methods.
 */
export function problems(msg, sent = new Map()) {
  if (msg?.jsonrpc !== "2.0") return ["not JSON-RPC 2.0"];
  if ("method" in msg) {
    if (msg.method.startsWith("_")) return []; // extensions: ours, documented
    const d = defs[msg.method];
    const def = "id" in msg ? d?.request : d?.notification ?? d?.request;
    return def ? check(def, msg.params) : [`unknown method ${msg.method}`];
  }
  if ("error" in msg) return check("Error", msg.error);
  const method = sent.get(msg.id);
  sent.delete(msg.id);
  if (!method || method.startsWith("_")) return [];
  const def = defs[method]?.response;
  return def ? check(def, msg.result) : [`response to unknown method ${method}`];
}

/** Checks one message from the daemon; a violation fails the test file. */
export function checkIncoming(msg, sent) {
  checked += 1;
  const found = problems(msg, sent);
  if (found.length) violations.push({ problems: found, msg });
}

/**
 * Wraps an ACP stream (`{readable, writable}` of JSON-RPC objects) so that
 * every message read from it is checked.
 */
export function validated(stream) {
  const sent = new Map();
  const outgoing = new TransformStream({
    transform(msg, ctl) {
      if (msg && "method" in msg && "id" in msg) sent.set(msg.id, msg.method);
      ctl.enqueue(msg);
    },
  });
  outgoing.readable.pipeTo(stream.writable).catch(() => {});
  const incoming = new TransformStream({
    transform(msg, ctl) {
      checkIncoming(msg, sent);
      ctl.enqueue(msg);
    },
  });
  return { readable: stream.readable.pipeThrough(incoming), writable: outgoing.writable };
}
